"""aserve's CPU bf16 GEMM (`aserve/kernels/cpu_gemm.py`) beside oneDNN's prepacked linear (the
engine's previous path) and `F.linear`, on a model's linear shapes; one JSON line.

    python benchmarks/studies/gemm.py --model /tmp/models/smol [--rows 1,8,64,512]

Two measures per row count:
- "hot": each layer shape alone, its weight in cache (best of repeats): GFLOP/s per kernel;
- "stream": one decode step's worth of GEMMs over ALL the model's weights (every layer's
  shapes, then the LM head), so weights come from memory as in a real step: ms per step and
  the weight bytes streamed per second.
Ratios are oneDNN time / aserve time (above 1: aserve faster), measured in the same run; where
oneDNN has no bf16 linear (AVX2-only hosts), F.linear's ("reference" names which). On a
CPU with AMX, aserve's GEMM runs on AMX tiles; "aserve_vector" is the same GEMM kept on the
vector tiles (`cpu_gemm.amx(False)`), and "amx_over_vector" their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: aserve
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common

from common import best_time  # noqa: E402
from matmul_limit import LinearShapes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (its config.json)")
    ap.add_argument("--rows", default="1,8,64,512")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from aserve.kernels import cpu_gemm

    if not cpu_gemm.available():
        print(json.dumps({"benchmark": "gemm", "error": "no AVX512-BF16 build on this CPU"}))
        return 1
    shapes = LinearShapes.from_config(args.model)
    torch.manual_seed(0)
    def aserve(w):
        packed = cpu_gemm.PackedWeight(w)
        return packed.linear

    def onednn(w):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def f_linear(w):
        return lambda x: F.linear(x, w)

    def aserve_vector(w):  # the vector tiles where aserve would take the AMX ones
        packed = cpu_gemm.PackedWeight(w)

        def linear(x):
            cpu_gemm.amx(False)
            try:
                return packed.linear(x)
            finally:
                cpu_gemm.amx(True)
        return linear

    kernels = {"aserve": aserve, "onednn": onednn, "f_linear": f_linear}  # weight -> fn(x)
    try:  # oneDNN's bf16 linear needs AVX-512 (or AVX-NE-CONVERT): on AVX2 hosts, F.linear's
        onednn(torch.randn(64, 64, dtype=torch.bfloat16))(torch.randn(1, 64).bfloat16())
        reference = "onednn"
    except RuntimeError:
        del kernels["onednn"]
        reference = "f_linear"
    amx = cpu_gemm.amx()
    if amx:
        kernels["aserve_vector"] = aserve_vector
    report: dict = {"benchmark": "gemm", "model": args.model, "threads": torch.get_num_threads(),
                    "amx": amx, "reference": reference, "hot": {}, "stream": {}}
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            for k, n in (*shapes.layer, shapes.head):
                w = torch.randn(n, k, dtype=torch.bfloat16)
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                gflops = {}
                for name, make in kernels.items():
                    fn = make(w)
                    gflops[name] = round(2 * rows * k * n / best_time(lambda fn=fn, x=x: fn(x))
                                         / 1e9)
                gflops["ratio"] = round(gflops["aserve"] / gflops[reference], 2)
                if amx:
                    gflops["amx_over_vector"] = round(gflops["aserve"] / gflops["aserve_vector"],
                                                      2)
                report["hot"][f"{rows}x{n}x{k}"] = gflops
        weight_bytes = 2 * (sum(k * n for k, n in shapes.layer) * shapes.num_layers
                            + shapes.head[0] * shapes.head[1])
        for name in ("aserve", reference, *(("aserve_vector",) if amx else ())):
            layers = [[kernels[name](torch.randn(n, k, dtype=torch.bfloat16))
                       for k, n in shapes.layer] for _ in range(shapes.num_layers)]
            head = kernels[name](torch.randn(shapes.head[1], shapes.head[0], dtype=torch.bfloat16))
            for rows in (1, 8, 64):
                xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k, _ in shapes.layer}

                def step(xs=xs, layers=layers, head=head):
                    for fns in layers:
                        for (k, _), fn in zip(shapes.layer, fns, strict=True):
                            fn(xs[k])
                    head(xs[shapes.head[0]])

                seconds = best_time(step, min_repeats=3, budget_s=1.0)
                report["stream"].setdefault(str(rows), {})[name] = {
                    "ms_per_step": round(1e3 * seconds, 2),
                    "weight_gb_per_s": round(weight_bytes / seconds / 1e9, 1)}
            del layers, head
        for entry in report["stream"].values():
            entry["ratio"] = round(entry[reference]["ms_per_step"]
                                   / entry["aserve"]["ms_per_step"], 2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
