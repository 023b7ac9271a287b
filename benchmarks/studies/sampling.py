"""Sampling: what drawing a batch of random rows costs, the way GPUs draw (vLLM's: exponential
race, top-p over a sorted vocabulary) beside the way aserve's CPU platform draws (inverse CDF,
top-p among each row's best tokens first, top-k by selection). Prints one JSON line.

    python benchmarks/studies/sampling.py [--rows 32] [--vocab 49152] [--quick]

Both samplers are aserve's `Sampler` (aserve/runner/sampler.py) on the same logits, timed in
alternation (best of `--repeats` per case: noise only slows a call down); `ratio` is the
device-style time over the host-style one. Logits are synthetic, seeded, of two shapes:

    peaked   a trained model's shape: a few tokens hold most of the mass (Zipf-like, s = 1.2)
    flat     a random-weight model's: every token within a few nats of the best

Cases: temperature 1 (unseeded and seeded), top_k 40, top_p 0.9, top_k 50 + top_p 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: aserve

import torch  # noqa: E402

from aserve.runner.request_state import CachedRequestState  # noqa: E402
from aserve.runner.sampler import Sampler  # noqa: E402
from aserve.runner.sampling_metadata import SamplingMetadata  # noqa: E402
from aserve.sampling_params import SamplingParams  # noqa: E402

CASES = {
    "temperature_1": dict(temperature=1.0),
    "temperature_1_seeded": dict(temperature=1.0, seed=7),
    "top_k_40": dict(temperature=0.8, top_k=40),
    "top_p_0.9": dict(temperature=0.8, top_p=0.9),
    "top_k_50_top_p_0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
}
SAMPLERS = {"device_style": dict(random_sampling="race", top_p_candidates=0),
            "host_style": dict(random_sampling="inverse_cdf", top_p_candidates=256)}


def make_logits(shape: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if shape == "flat":
        return torch.randn(rows, vocab, generator=gen)
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]) + 1
    return -1.2 * ranks.double().log().float() + 0.1 * torch.randn(rows, vocab, generator=gen)


def metadata(rows: int, vocab: int, params: dict) -> SamplingMetadata:
    states = [CachedRequestState(f"r{i}", [1, 2, 3], SamplingParams(**params), 3)
              for i in range(rows)]
    return SamplingMetadata.build(states, vocab, "cpu",
                                  generator=torch.Generator().manual_seed(0))


def run(rows: int, vocab: int, repeats: int) -> dict:
    samplers = {name: Sampler(**kwargs) for name, kwargs in SAMPLERS.items()}
    results = {}
    for shape in ("peaked", "flat"):
        logits = make_logits(shape, rows, vocab, seed=0)
        for case, params in CASES.items():
            md = metadata(rows, vocab, params)
            times = {name: [] for name in samplers}
            for sampler in samplers.values():
                sampler(logits, md)  # (warm-up)
            for _ in range(repeats):  # alternating, so that drift hits both alike
                for name, sampler in samplers.items():
                    start = time.perf_counter()
                    sampler(logits, md)
                    times[name].append(time.perf_counter() - start)
            ms = {name: round(min(t) * 1e3, 3) for name, t in times.items()}
            results[f"{shape}/{case}"] = {
                **{f"{name}_ms": value for name, value in ms.items()},
                "ratio": round(ms["device_style"] / ms["host_style"], 2)}
            print(f"{shape}/{case}: {results[f'{shape}/{case}']}", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="8 x 4096, 2 repeats (the test)")
    ns = parser.parse_args()
    if ns.quick:
        ns.rows, ns.vocab, ns.repeats = 8, 4096, 2
    report = {"benchmark": "sampling", "rows": ns.rows, "vocab": ns.vocab,
              "repeats": ns.repeats, "torch_threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "cases": run(ns.rows, ns.vocab, ns.repeats)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
