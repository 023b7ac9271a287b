"""The CPU decoder stack as one C++ call (`cpu_block.CpuDecoderStack`) against the layers called
one by one (`CpuDecoderBlock` each), in ONE engine, alternated request by request so that the
machine's swings fall on both. Prints one JSON line.

    python benchmarks/studies/decoder_stack.py --model DIR [--batch 1] [--rounds 8] [-o 128]

Each round runs `--batch` requests of 16 prompt tokens and `-o` greedy output tokens once per
mode (the order flips every round). Per mode: ms per output token (wall) and the forward's ms
per decode step (the engine's step log), medians over rounds; `layers_over_stack` is the
median of the rounds' ratios (above 1: the stack is faster). The outputs of the two modes must
be equal token for token, or the run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS.parent))  # the repo: aserve
sys.path.insert(0, str(BENCHMARKS))  # common

from common import emit, make_prompts, vocab_size_of  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from dataclasses import replace

    from aserve import LLM, SamplingParams
    from aserve.backends.ops import fuse_layers

    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=args.batch)
    prompts = [{"prompt_token_ids": p}
               for p in make_prompts(args.batch, 16, vocab_size_of(args.model))]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    core = llm.engine_core
    runner = core.executor.worker.runner
    stack = runner.model.model  # the DecoderStack: its one segment's call is the platform's
    [(first, end, stacked)] = stack.segments
    layers = fuse_layers(replace(runner.ops, decoder_stack=None), list(stack.owned_layers()))
    modes = {"stack": stacked, "layers": layers}  # layers: each layer's block, one by one
    tpot: dict[str, list[float]] = {m: [] for m in modes}
    forward: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    try:
        for r in range(args.rounds):
            for mode in (list(modes) if r % 2 == 0 else list(reversed(modes))):
                stack.segments = [(first, end, modes[mode])]
                llm.reset_prefix_cache()
                since, t0 = time.monotonic(), time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - t0
                decodes = [s for s in core.step_log.snapshot() if s[0] >= since and s[1] == 0]
                tpot[mode].append(1e3 * wall / args.output_len)
                forward[mode].append(1e3 * statistics.mean(s[3] for s in decodes))
                tokens.setdefault(mode, [o.outputs[0].token_ids for o in outs])
    finally:
        stack.segments = [(first, end, stacked)]
        core.shutdown()
    if tokens["stack"] != tokens["layers"]:
        print("error: the stack's tokens differ from the layers'", file=sys.stderr)
        return 1

    def ratio(series):
        return round(statistics.median(
            a / b for a, b in zip(series["layers"], series["stack"], strict=True)), 3)

    emit({"benchmark": "decoder_stack", "model": args.model, "batch": args.batch,
          "rounds": args.rounds, "output_len": args.output_len,
          **{m: {"ms_per_token": round(statistics.median(tpot[m]), 3),
                 "forward_ms_per_step": round(statistics.median(forward[m]), 3)} for m in modes},
          "layers_over_stack": {"ms_per_token": ratio(tpot), "forward": ratio(forward)}},
         args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
