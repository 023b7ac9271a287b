"""Sharing the cores (issue 45, item 6): aserve's offline throughput alone and beside busy
processes, under the thread settings that decide how it shares. Prints one JSON line.

    python benchmarks/contention.py --model DIR [-n 16 -i 64 -o 64] [--busy 1] [--rounds 2]

Each setting runs `benchmarks/throughput.py` in a fresh process (the OpenMP settings are read
once, at start), the settings in turn, `--rounds` times (the best round counts: noise only
slows a run down):

    alone            aserve's defaults, nothing else running
    alone_passive    OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep at once, not spin)
    busy             beside --busy processes that spin on the CPU, unpinned
    busy_passive     the same, OMP_WAIT_POLICY=PASSIVE
    busy_pinned      aserve on all cores but the last --busy ones (taskset), the busy
                     processes on those: the cores split, not shared

"Proportionate": beside one busy process on 2 cores aserve has half the CPU, so about half of
`alone`; an OpenMP team whose threads spin at every barrier while one of them waits for its core
falls far below that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = ("alone", "alone_passive", "busy", "busy_passive", "busy_pinned")
SPIN = "while True: pass"


def throughput(args: argparse.Namespace, env: dict[str, str], cpus: list[int] | None) -> float:
    cmd = [sys.executable, str(HERE / "throughput.py"), "--model", args.model,
           "-n", str(args.num_prompts), "-i", str(args.input_len), "-o", str(args.output_len)]
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                         timeout=args.timeout).stdout
    return json.loads(out.strip().splitlines()[-1])["aserve"]["output_tokens_per_s"]


def run_setting(args: argparse.Namespace, setting: str) -> float:
    env = dict(os.environ)
    if setting.endswith("passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cpus = sorted(os.sched_getaffinity(0))
    busy, mine = [], None
    if setting.startswith("busy"):
        pinned = setting == "busy_pinned"
        mine = cpus[:-args.busy] if pinned else None
        for i in range(args.busy):
            spin = [sys.executable, "-c", SPIN]
            if pinned:
                spin = ["taskset", "-c", str(cpus[-1 - i]), *spin]
            busy.append(subprocess.Popen(spin))
        time.sleep(0.5)
    try:
        return throughput(args, env, mine)
    finally:
        for process in busy:
            process.kill()
            process.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", "--num-prompts", type=int, default=16)
    ap.add_argument("-i", "--input-len", type=int, default=64)
    ap.add_argument("-o", "--output-len", type=int, default=64)
    ap.add_argument("--busy", type=int, default=1, help="busy processes (and cores pinned)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    settings = args.settings.split(",")
    if args.busy >= len(os.sched_getaffinity(0)) and "busy_pinned" in settings:
        ap.error("--busy must leave aserve a core for busy_pinned")
    rounds: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for setting in settings:
            rounds[setting].append(run_setting(args, setting))
            print(f"round {r}: {setting} {rounds[setting][-1]}", file=sys.stderr, flush=True)
    best = {s: max(v) for s, v in rounds.items()}
    result = {"benchmark": "contention", "model": args.model, "cpus": len(os.sched_getaffinity(0)),
              "busy": args.busy, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "output_tokens_per_s": best, "rounds": rounds}
    if "alone" in best:
        result["of_alone"] = {s: round(v / best["alone"], 3) for s, v in best.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
