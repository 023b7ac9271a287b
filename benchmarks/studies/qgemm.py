"""The CPU int4 / int6 / int8 GEMM (`kernels/cpu_qgemm.py`) against aserve's bf16 GEMM on one decode
step's weights: every linear of --layers layers of smol's (or Llama-3.2-1B's) shapes (qkv, o,
gate_up packed gated, down), each kind in its own huge-page buffer, applied to --rows rows in
turns for --rounds rounds (the best round each). Prints one JSON line: ms a step, MB of
packed weights, GB/s.

    python benchmarks/studies/qgemm.py [--shape smol|llama1b] [--rows 1] [--layers 30]
        [--rounds 7] [--group 32] [--quick]

The question it answers: how fast the integer kernels stream their (fewer) bytes beside the
bf16 kernel (docs/benchmarks/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {  # a layer's linears: (outputs, inputs, gated)
    "smol": [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False)],
    "llama1b": [(3072, 2048, False), (2048, 2048, False), (16384, 2048, True),
                (2048, 8192, False)],
}


def main(argv: list[str] | None = None) -> int:
    import torch

    from aserve.kernels import cpu_gemm, cpu_qgemm
    from aserve.quantization.int_weights import IntWeight

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smol")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--group", type=int, default=32, help="inputs a scale (Q6_K's: 16)")
    p.add_argument("--quick", action="store_true", help="2 layers, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.rounds = 2, 2
    if not cpu_qgemm.available():
        print(json.dumps({"benchmark": "qgemm", "skipped": "no AVX512-VNNI or AVX2 build"}))
        return 0
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES[args.shape] * args.layers

    def integer(bits: int) -> list:
        out = []
        for n, k, gated in shapes:
            q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
            # fp16 scales, mins -2^(bits-1) scale: symmetric (Q8_0, Q4_0, Q5_0, Q6_K...)
            scale = (torch.rand(n, k // args.group, generator=gen) * 0.01 + 1e-3).half().float()
            out.append(cpu_qgemm.QuantPackedWeight(
                IntWeight(q, scale, -scale * 2 ** (bits - 1), args.group, bits), gated))
        return out

    kinds = {"bf16": [cpu_gemm.PackedWeight(torch.randn(n, k, generator=gen).bfloat16(), g)
                      for n, k, g in shapes], "int8": integer(8), "int6": integer(6),
             "int5": integer(5), "int4": integer(4)}
    buffers = [cpu_gemm.gather_in_huge_pages(ws) for ws in kinds.values()]  # kept alive
    xs = {k: torch.randn(args.rows, k, generator=gen).bfloat16() for _, k, _ in shapes}
    times = {name: [] for name in kinds}
    for _ in range(args.rounds):
        for name, weights in kinds.items():
            t0 = time.perf_counter()
            for weight in weights:
                weight.linear(xs[weight.in_features])
            times[name].append(time.perf_counter() - t0)
    result = {"benchmark": "qgemm", "shape": args.shape, "rows": args.rows, "layers": args.layers,
              "group": args.group,
              "rounds": args.rounds, "threads": torch.get_num_threads(),
              "huge_pages": all(b is not None for b in buffers)}
    for name, weights in kinds.items():
        nbytes = sum(w.data.numel() * w.data.element_size() for w in weights)
        best = min(times[name])
        result[name] = {"ms": round(best * 1e3, 3), "mb": round(nbytes / 1e6, 1),
                        "gb_s": round(nbytes / best / 1e9, 1)}
    for name in ("int8", "int6", "int5", "int4"):
        result[f"{name}_over_bf16"] = round(result[name]["ms"] / result["bf16"]["ms"], 3)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
