"""The startup heap frozen out of the cyclic GC (`executor.base.StartupHeap`) against the same
engine with it thawed, in ONE process, alternated round by round. Prints one JSON line.

    python benchmarks/studies/gc_heap.py --model DIR [--rounds 6] [-n 256] [-i 16] [-o 128]

Each round runs `-n` requests offline (random prompts of `-i` tokens, `-o` greedy output
tokens, `ignore_eos`); the mode flips every round (`gc.unfreeze()` hands the frozen objects
back to the collector, `gc.freeze()` takes them again). `gc.callbacks` time every collection
by generation. Per mode: output tok/s (median of rounds), full (generation 2) collections and
the milliseconds they took per round, and the longest gap between two engine steps (a full
collection stalls the whole process under the GIL, every stream's next token included).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS.parent))  # the repo: aserve
sys.path.insert(0, str(BENCHMARKS))  # common

from common import emit, make_prompts, vocab_size_of  # noqa: E402


class Collections:
    """Every collection's generation and duration, from `gc.callbacks`."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        generation = info["generation"]
        self.counts[generation] += 1
        self.seconds[generation] += time.perf_counter() - self.started

    def reset(self) -> None:
        self.seconds, self.counts = [0.0, 0.0, 0.0], [0, 0, 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=6, help="per mode")
    ap.add_argument("-n", "--num-prompts", type=int, default=256)
    ap.add_argument("-i", "--input-len", type=int, default=16)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from aserve import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=args.num_prompts)
    frozen_count = gc.get_freeze_count()
    prompts = [{"prompt_token_ids": p} for p in make_prompts(
        args.num_prompts, args.input_len, vocab_size_of(args.model))]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    core, step = llm.engine_core, llm.engine_core.step
    gaps: list[float] = []

    def timed_step():
        out = step()
        now = time.perf_counter()
        gaps.append(now - timed_step.last)
        timed_step.last = now
        return out

    core.step = timed_step
    collections = Collections()
    modes = {m: {"tok_s": [], "full_collections": 0, "full_ms": [], "young_ms": [],
                 "max_step_gap_ms": []} for m in ("frozen", "thawed")}
    for r in range(2 * args.rounds):
        mode = ("frozen", "thawed")[(r + r // 2) % 2]  # frozen, thawed, thawed, frozen, ...
        if mode == "thawed":
            gc.unfreeze()
        llm.reset_prefix_cache()
        collections.reset()
        gaps.clear()
        timed_step.last = t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        if mode == "thawed":
            gc.freeze()  # (what the thawed round made is frozen too: young, a small share)
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        entry = modes[mode]
        entry["tok_s"].append(num_out / elapsed)
        entry["full_collections"] += collections.counts[2]
        entry["full_ms"].append(1000 * collections.seconds[2])
        entry["young_ms"].append(1000 * (collections.seconds[0] + collections.seconds[1]))
        entry["max_step_gap_ms"].append(1000 * max(gaps))
    llm.shutdown()
    result = {"benchmark": "gc_heap", "model": args.model, "rounds": args.rounds,
              "requests": f"{args.num_prompts} x {args.input_len}/{args.output_len}",
              "frozen_objects": frozen_count}
    for mode, entry in modes.items():
        result[mode] = {
            "output_tok_s_median": round(statistics.median(entry["tok_s"]), 1),
            "full_collections": entry["full_collections"],
            "full_collection_ms_per_round": round(sum(entry["full_ms"]) / args.rounds, 1),
            "young_collection_ms_per_round": round(sum(entry["young_ms"]) / args.rounds, 1),
            "max_step_gap_ms": round(max(entry["max_step_gap_ms"]), 1),
            "median_of_rounds_max_step_gap_ms": round(
                statistics.median(entry["max_step_gap_ms"]), 1)}
    result["frozen_over_thawed_tok_s"] = round(
        result["frozen"]["output_tok_s_median"] / result["thawed"]["output_tok_s_median"], 3)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
