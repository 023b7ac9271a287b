"""Offline throughput: N synthetic requests (random token-id prompts, fixed input/output lengths,
`ignore_eos`), reported as one JSON line.

    python benchmarks/throughput.py --model DIR -n 64 -i 128 -o 128 [--compare-hf]
        [--no-async-scheduling | --compare-sync]

With `--compare-hf`, HF transformers `generate` runs the same prompts in static batches in the
same process run, and the line carries both figures and their ratio (these machines are noisy:
compare side by side, never against a number from another run). `--compare-sync` also runs aserve
without async scheduling (each step scheduled only after the previous one returned) and reports
the ratio async / sync.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_prompts  # noqa: E402


def run_aserve(args, prompts: list[list[int]], async_scheduling: bool = True) -> dict:
    from aserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=not args.no_prefix_caching,
              async_scheduling=async_scheduling,
              tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size,
              enable_expert_parallel=args.enable_expert_parallel, moe_combine=args.moe_combine)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[: min(4, len(prompts))]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.reset_prefix_cache()
    core = llm.engine_core
    steps_before, forward_before = core.num_steps, core.forward_seconds
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_steps = core.num_steps - steps_before
    forward = core.forward_seconds - forward_before
    # Engine overhead: wall time not spent in the model's forward (schedule, input preparation,
    # sampling, stop checks, detokenization that async scheduling did not hide), per step and as
    # a share of the run.
    llm.engine_core.shutdown()
    return summarize("aserve", len(prompts), num_out, sum(map(len, prompts)), elapsed,
                     async_scheduling=async_scheduling,
                     startup_s=round(startup, 2), num_steps=num_steps,
                     overhead_ms_per_step=round(1000 * (elapsed - forward) / num_steps, 3),
                     overhead_fraction=round((elapsed - forward) / elapsed, 4),
                     first_output_ids=list(outputs[0].outputs[0].token_ids[:8]))


def run_hf(args, prompts: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype or "auto").eval()
    model = model.to(args.hf_device)
    batch = args.hf_batch_size

    def generate(batch_prompts: list[list[int]], max_new: int) -> int:
        # all prompts have the same length: no padding
        ids = torch.tensor(batch_prompts, device=args.hf_device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    with torch.inference_mode():
        generate(prompts[:1], 4)  # warm-up
        t0 = time.perf_counter()
        num_out = sum(generate(prompts[i:i + batch], args.output_len)
                      for i in range(0, len(prompts), batch))
        elapsed = time.perf_counter() - t0
    return summarize("hf-transformers", len(prompts), num_out, sum(map(len, prompts)), elapsed,
                     batch_size=batch)


def summarize(engine: str, num_requests: int, num_output_tokens: int, num_prompt_tokens: int,
              elapsed: float, **extra) -> dict:
    return {
        "engine": engine,
        "num_requests": num_requests,
        "num_output_tokens": num_output_tokens,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(num_requests / elapsed, 3),
        "output_tokens_per_s": round(num_output_tokens / elapsed, 1),
        "total_tokens_per_s": round((num_output_tokens + num_prompt_tokens) / elapsed, 1),
        **extra,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("-n", "--num-prompts", type=int, default=64)
    ap.add_argument("-i", "--input-len", type=int, default=128)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="token budget of one step (default: the platform's)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    ap.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="MoE models: whole experts per tensor-parallel rank")
    ap.add_argument("--moe-combine", default="all-reduce", choices=["all-reduce", "all-to-all"],
                    help="with --enable-expert-parallel: how the experts' outputs meet")
    ap.add_argument("--compare-sync", action="store_true",
                    help="also run aserve without async scheduling; report async / sync")
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-device", default="cpu", help="where HF transformers runs (e.g. cuda)")
    args = ap.parse_args()

    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    result = {
        "benchmark": "throughput",
        "model": str(args.model),
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "moe_combine": args.moe_combine,
        "aserve": run_aserve(args, prompts, not args.no_async_scheduling),
    }
    if args.compare_sync:
        result["aserve_sync"] = run_aserve(args, prompts, async_scheduling=False)
        result["ratio_async_vs_sync"] = round(result["aserve"]["output_tokens_per_s"]
                                              / result["aserve_sync"]["output_tokens_per_s"], 3)
    if args.compare_hf:
        result["hf"] = run_hf(args, prompts)
        result["ratio_vs_hf"] = round(result["aserve"]["output_tokens_per_s"]
                                      / result["hf"]["output_tokens_per_s"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
