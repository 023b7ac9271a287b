#!/usr/bin/env python3
"""vLLM's speculative decoding on benchmarks/speculative.py's prompts, in the peers' venv: the
prompts (token ids, from --prompts, a JSON list) one at a time, greedy, --output-len tokens at
most, with --speculative-config (vLLM's JSON) or without; after a short warm-up, the best of
--repeats runs. Prints one JSON line: output tok/s, the replies' token ids, startup seconds.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \\
        ~/.cache/aserve-peers/venv/bin/python benchmarks/peers/speculative_vllm.py \\
        --model HF_DIR --prompts prompts.json [--speculative-config '{"method": "ngram", ...}']
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("-o", "--output-len", type=int, default=256)
    ap.add_argument("--speculative-config", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        prompts = [{"prompt_token_ids": ids} for ids in json.load(f)]
    engine = {"model": args.model, "dtype": "bfloat16", "max_model_len": 1024, "seed": 0}
    if args.speculative_config:
        engine["speculative_config"] = json.loads(args.speculative_config)
    start = time.perf_counter()
    llm = LLM(**engine)
    startup_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    best, replies = 0.0, []
    for _ in range(args.repeats):
        tokens, replies, start = 0, [], time.perf_counter()
        for prompt in prompts:  # concurrency 1
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            tokens += len(out.token_ids)
            replies.append(list(out.token_ids))
        best = max(best, tokens / (time.perf_counter() - start))
    print(json.dumps({"tok_s": best, "replies": replies, "startup_s": startup_s}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
