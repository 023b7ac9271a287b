"""aserve from two source trees (before / after a change) side by side on the same model and
workload, in one invocation, alternating the order over rounds; prints one JSON line of every
figure and the ratios after / before (progress goes to stderr).

    mkdir -p /tmp/aserve-before && git archive REV | tar -x -C /tmp/aserve-before
    python benchmarks/revisions.py --model /tmp/models/smol --before /tmp/aserve-before \\
        [--after DIR] [--offline] [--serve --concurrency 8,32] [--rounds 2]

--offline runs each tree's own `benchmarks/throughput.py` (-n/-i/-o as compare.py: 64 x 128 /
128); --serve starts `python -m aserve` from each tree and runs THIS repo's `benchmarks/serve.py`
against it at each concurrency (readiness, SIGTERM and process groups as compare.py). With
neither flag, both run. Rounds alternate the order (round 0: before first, round 1: after
first, ...). Default --after: this repo's working tree, uncommitted changes included.

Which aserve a child imports: aserve is usually pip-installed in editable mode from one tree, and
a child's working directory ('' on sys.path for -c / -m) comes before PYTHONPATH. So every child
starts through LAUNCH, which puts the tree first on sys.path (PYTHONPATH = the tree too, for
the processes it spawns), imports aserve, exits 3 unless `aserve.__file__` is inside the tree,
and reports that file on stderr; the JSON records it per tree ("trees") and per run.

Warm-up: before any timing, each tree's server is started once and serves a few requests, so
that its C++ extension (keyed by its source, so the trees' builds differ) is built and cached,
and neither readiness nor throughput counts the build; that start's readiness is "warmup_s".

Aggregation (compare.py's): the BEST round per tree (highest output tokens/s; for --serve, per
concurrency, that round's figures whole), since noise on a shared machine only ever slows a run
down; readiness: every round's, and the best (lowest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
from common import free_port  # noqa: E402
from compare import SERVE_FIELDS, Server, last_json_line, loadavg, rotated  # noqa: E402

TREES = ("before", "after")
MARK = "[revisions] aserve from "

# python -c LAUNCH TREE (module NAME | path SCRIPT | probe) ARGS...
LAUNCH = """\
import os, sys, runpy
tree = os.path.realpath(sys.argv[1])
sys.path[0:1] = [tree]
import aserve
where = os.path.realpath(aserve.__file__)
if not where.startswith(tree + os.sep):
    sys.exit(f"aserve was imported from {where}, not from {tree}")
print(__MARK__ + where, file=sys.stderr, flush=True)
kind, target = sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
sys.argv = [target, *sys.argv[4:]]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
elif kind == "path":
    runpy.run_path(target, run_name="__main__")
""".replace("__MARK__", repr(MARK))


def log(message: str) -> None:
    message = message.replace(shlex.quote(LAUNCH), "$LAUNCH")  # commands' launcher, as a name
    print(f"[revisions {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


compare.log = log  # compare's Server logs its commands through its module's `log`


def tree_env(tree: Path) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath}


def launch(tree: Path, kind: str, target: str = "", *args: str) -> list[str]:
    return [sys.executable, "-c", LAUNCH, str(tree), kind, target, *args]


def imported_from(text: str) -> str | None:
    """The aserve file LAUNCH reported in a child's stderr / log."""
    for line in text.splitlines():
        if line.startswith(MARK):
            return line[len(MARK):].strip()
    return None


def describe_tree(tree: Path) -> dict:
    """Where the tree's children import aserve from (a probe through LAUNCH), its git commit if
    it is a checkout (and whether it has uncommitted changes), and a digest of aserve/'s files."""
    probe = subprocess.run(launch(tree, "probe"), capture_output=True, text=True, timeout=120,
                           env=tree_env(tree), cwd=ROOT)
    if probe.returncode != 0:
        raise RuntimeError(f"{tree}: {probe.stderr.strip()[-2000:]}")
    info: dict = {"path": str(tree), "aserve_file": imported_from(probe.stderr)}
    git = ["git", "-C", str(tree)]
    top = subprocess.run([*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == tree:
        info["git_commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True,
                                            text=True).stdout.strip()
        info["git_dirty"] = bool(subprocess.run(
            [*git, "status", "--porcelain", "--", "aserve", "benchmarks"],
            capture_output=True, text=True).stdout.strip())
    digest = hashlib.sha256()
    for path in sorted((tree / "aserve").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    info["aserve_sha256"] = digest.hexdigest()[:16]
    return info


def run_json(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """compare.run_json, plus the aserve file LAUNCH reported (as "aserve_file")."""
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    result = last_json_line(proc.stdout)
    if result is None:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"{shlex.join(cmd[-8:])} exited {proc.returncode} without a JSON line")
    where = imported_from(proc.stderr)
    return {**result, "aserve_file": where} if where else result


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# ---------------------------------------------------------------------------------- offline

def offline_round(args: argparse.Namespace, which: str) -> dict:
    tree = args.trees[which]
    result = run_json(launch(tree, "path", str(tree / "benchmarks" / "throughput.py"),
                             "--model", args.model, "-n", str(args.num_prompts),
                             "-i", str(args.input_len), "-o", str(args.output_len),
                             "--dtype", args.dtype),
                      args.offline_timeout, env=tree_env(tree))
    a = result["aserve"]
    return {"output_tokens_per_s": a["output_tokens_per_s"], "startup_s": a.get("startup_s"),
            "overhead_ms_per_step": a.get("overhead_ms_per_step"),
            "aserve_file": result.get("aserve_file")}


def aggregate_offline(runs: dict[str, list[dict]]) -> dict:
    """Per tree, the best round's output tok/s (every round kept); after / before."""
    report: dict = {}
    for which, rounds in runs.items():
        report[which] = {"output_tokens_per_s": max(x["output_tokens_per_s"] for x in rounds),
                         "rounds": rounds}
    if set(TREES) <= set(report):
        report["after_over_before"] = ratio(report["after"]["output_tokens_per_s"],
                                            report["before"]["output_tokens_per_s"])
    return report


def run_offline(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for which in rotated(list(TREES), r):
            log(f"offline round {r}: {which}")
            load = loadavg()
            figures = offline_round(args, which)
            log(f"{which}: {figures['output_tokens_per_s']} out tok/s")
            runs.setdefault(which, []).append({**figures, "loadavg_1m": load})
    return {"num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, **aggregate_offline(runs)}


# ---------------------------------------------------------------------------------- serving

def start_server(args: argparse.Namespace, which: str, name: str,
                 servers: list[Server]) -> Server:
    tree, port = args.trees[which], args.port or free_port()
    cmd = launch(tree, "module", "aserve", "--model", args.model, "--host", "127.0.0.1",
                 "--port", str(port), "--dtype", args.dtype, *shlex.split(args.aserve_args))
    server = Server(cmd, tree_env(tree), args.workdir / f"{name}.log", port)
    servers.append(server)
    return server


def serve_bench(args: argparse.Namespace, server: Server, c: int, n: int, output_len: int,
                raw: Path) -> dict:
    return run_json(
        [sys.executable, str(HERE / "serve.py"), "--base-url", server.url, "--tokenizer",
         args.model, "--prompt-kind", args.prompt_kind, "-n", str(n), "-i", str(args.input_len),
         "-o", str(output_len), "--concurrency", str(c), "--timeout", str(args.request_timeout),
         "--save-raw", str(raw)], args.request_timeout + 60)


def warm_up(args: argparse.Namespace, which: str, servers: list[Server]) -> float:
    """Start the tree's server once (building its extension) and serve a few short requests;
    the readiness of that start, build included."""
    server = start_server(args, which, f"{which}_warmup", servers)
    try:
        ready = server.wait_ready(args.ready_timeout)
        c = min(args.concurrency)
        serve_bench(args, server, c, c, 4, args.workdir / f"{which}_warmup.jsonl")
        return round(ready, 2)
    finally:
        server.stop()


def serve_round(args: argparse.Namespace, which: str, r: int, servers: list[Server]) -> dict:
    """Start the tree's server, time its readiness, run serve.py at each concurrency."""
    load = loadavg()
    server = start_server(args, which, f"{which}_r{r}", servers)
    try:
        ready = server.wait_ready(args.ready_timeout)
        log(f"{which} ready in {ready:.1f} s")
        by_c = {}
        for c in args.concurrency:
            raw = args.workdir / f"{which}_c{c}_r{r}.jsonl"
            result = serve_bench(args, server, c, args.serve_num_prompts or 4 * c,
                                 args.output_len, raw)
            by_c[str(c)] = {**result, "raw": str(raw)}
            log(f"{which} c={c}: {result['output_tokens_per_s']} out tok/s, TTFT p50 "
                f"{result['ttft_ms']['p50']} ms, {result['failed']} failed")
    finally:
        server.stop()
    return {"readiness_s": round(ready, 2), "by_concurrency": by_c, "loadavg_1m": load,
            "aserve_file": imported_from(server.log_path.read_text())}


def aggregate_serve(rounds: dict[str, list[dict]], concurrency: list[int]) -> dict:
    """Per tree and concurrency, the best round's figures whole (every round's output tok/s
    kept); readiness best and per round; after / before of output tok/s, TTFT p50 and TPOT p50
    per concurrency, and of the best readiness."""
    report: dict = {"trees": {}, "readiness_s": {}, "loadavg_1m": {}, "aserve_file": {}}
    for which, runs in rounds.items():
        readiness = [x["readiness_s"] for x in runs]
        report["readiness_s"][which] = {"best": min(readiness), "rounds": readiness}
        report["loadavg_1m"][which] = [x["loadavg_1m"] for x in runs]
        report["aserve_file"][which] = sorted({str(x.get("aserve_file")) for x in runs})
        report["trees"][which] = {}
        for c in map(str, concurrency):
            per_round = [x["by_concurrency"][c] for x in runs]
            best = max(per_round, key=lambda x: x["output_tokens_per_s"])
            report["trees"][which][c] = {
                "num_prompts": best["num_prompts"], **{k: best.get(k) for k in SERVE_FIELDS},
                "rounds_output_tokens_per_s": [x["output_tokens_per_s"] for x in per_round]}
    if set(TREES) <= set(rounds):
        after, before = report["trees"]["after"], report["trees"]["before"]
        report["after_over_before"] = {
            c: {"output_tokens_per_s": ratio(after[c]["output_tokens_per_s"],
                                             before[c]["output_tokens_per_s"]),
                **{f"{k}_p50": ratio(after[c][f"{k}_ms"]["p50"], before[c][f"{k}_ms"]["p50"])
                   for k in ("ttft", "tpot")}}
            for c in map(str, concurrency)}
        report["readiness_s"]["after_over_before"] = ratio(
            report["readiness_s"]["after"]["best"], report["readiness_s"]["before"]["best"])
    return report


def run_serve(args: argparse.Namespace, servers: list[Server]) -> dict:
    rounds: dict[str, list[dict]] = {w: [] for w in TREES}
    for r in range(args.rounds):
        for which in rotated(list(TREES), r):
            log(f"serve round {r}: {which}")
            rounds[which].append(serve_round(args, which, r, servers))
    return {"input_len": args.input_len, "output_len": args.output_len,
            "prompt_kind": args.prompt_kind, "concurrency": args.concurrency,
            **aggregate_serve(rounds, args.concurrency)}


# ---------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory, served by both")
    ap.add_argument("--before", type=Path, required=True, help="the source tree before")
    ap.add_argument("--after", type=Path, default=ROOT, help="the tree after (default: this)")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--num-prompts", type=int, default=64, help="offline requests")
    ap.add_argument("-i", "--input-len", type=int, default=128)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="8,32", help="serve: comma-separated")
    ap.add_argument("--serve-num-prompts", type=int, default=None,
                    help="serve: requests per concurrency (default: 4 x concurrency)")
    ap.add_argument("--prompt-kind", choices=["ids", "text"], default="ids")
    ap.add_argument("--aserve-args", default="", help="extra `python -m aserve` flags (both)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the warm-up start of each tree (builds then count in round 0)")
    ap.add_argument("--port", type=int, default=None, help="(default: a free port per start)")
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
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if args.rounds < 1 or not args.concurrency:
        raise SystemExit("--rounds >= 1 and at least one --concurrency")
    args.trees = {w: getattr(args, w).expanduser().resolve() for w in TREES}
    for which, tree in args.trees.items():
        if not (tree / "aserve" / "__init__.py").is_file():
            raise SystemExit(f"--{which} {tree}: no aserve/ package there")
        if args.offline and not (tree / "benchmarks" / "throughput.py").is_file():
            raise SystemExit(f"--{which} {tree}: no benchmarks/throughput.py there")
    if args.trees["before"] == args.trees["after"]:
        log("warning: --before and --after are the same tree")
    compare.resolve_paths(args, "aserve-revisions-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = compare.begin(args, "revisions", "best round per tree")
    servers: list[Server] = []
    try:
        result["trees"] = {w: describe_tree(t) for w, t in args.trees.items()}
        for which, info in result["trees"].items():
            log(f"{which}: aserve from {info['aserve_file']}")
        if not args.no_warmup:
            for which in TREES:
                log(f"warm-up start of {which} (builds its C++ extension if not cached)")
                result["trees"][which]["warmup_s"] = warm_up(args, which, servers)
                log(f"{which} warm: ready in {result['trees'][which]['warmup_s']} s")
        if args.offline:
            result["offline"] = run_offline(args)
        if args.serve:
            result["serve"] = run_serve(args, servers)
    finally:
        for server in servers:
            server.stop(grace=10)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
