"""The first offline batch against the steady state (issue 19, warm-up): in each of --processes
fresh processes, `LLM(...)` is built (timed: the ready time) and the same batch generated
--batches times; prints one JSON line with each batch's output tokens/s, the first batch as a
fraction of the best later one, per process and the median over processes, and what the
first batch paid that the later ones did not: the process' minor page faults and the model's
forward seconds.

    python benchmarks/warmup.py --model DIR [-n 64 -i 128 -o 128] [--processes 3] [--batches 3]

The goal is a first batch within 5 % of the steady state (ratio >= 0.95). The prefix cache is
reset between batches, so every batch computes its prompts.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import emit, make_prompts, vocab_size_of  # noqa: E402


def one_process(args: argparse.Namespace) -> dict:
    from aserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, **json.loads(args.llm_kwargs))
    ready_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p}
               for p in make_prompts(args.num_prompts, args.input_len, vocab_size_of(args.model))]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    core = llm.engine_core
    batches = []
    for _ in range(args.batches):
        llm.reset_prefix_cache()
        faults, forward = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, core.forward_seconds
        t = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        batches.append({
            "output_tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 3),
            "forward_s": round(core.forward_seconds - forward, 3),
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    core.shutdown()
    steady = max(b["output_tok_s"] for b in batches[1:])
    return {"ready_s": round(ready_s, 2), "batches": batches,
            "first_over_steady": round(batches[0]["output_tok_s"] / steady, 4)}


def run(args: argparse.Namespace) -> dict:
    processes = []
    for _ in range(args.processes):
        cmd = [sys.executable, __file__, "--one-process", *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"a process failed:\n{out.stderr[-3000:]}")
        processes.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(processes[-1]), file=sys.stderr, flush=True)
    return {"benchmark": "warmup", "model": args.model, "dtype": args.dtype,
            "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                         "output_len": args.output_len},
            "first_over_steady_median": statistics.median(
                p["first_over_steady"] for p in processes),
            "ready_s_median": statistics.median(p["ready_s"] for p in processes),
            "processes": processes}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("-n", "--num-prompts", type=int, default=64)
    p.add_argument("-i", "--input-len", type=int, default=128)
    p.add_argument("-o", "--output-len", type=int, default=128)
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--llm-kwargs", default="{}", help="more LLM(...) arguments, as JSON")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batches < 2:
        raise SystemExit("--batches must be at least 2 (the first, and a steady one)")
    if args.one_process:
        print(json.dumps(one_process(args)), flush=True)
        return 0
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
