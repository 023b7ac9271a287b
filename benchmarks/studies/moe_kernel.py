"""aserve's CPU bf16 fused MoE (`aserve/kernels/cpu_moe.py`) beside the dense per-expert loop it
replaces, on Mixtral-shaped MoE layers scaled to this machine; one JSON line. With `--int 4`
(or 8), the same experts as integers in groups of 32 too (`cpu_qgemm.QuantFusedMoE`): its one
C++ call (`int_fused`) and its per-expert loop (`int_loop`).

    python benchmarks/studies/moe_kernel.py [--hidden 1024 --intermediate 2816 --experts 8
                                            --top-k 2 --layers 4 --tokens 1,8,64,256]
                                            [--int 4]

The dense loop is the engine's best path without the fused op: a `PackedWeight` per expert
(gate_up packed gated, silu in its epilogue; down plain), all in huge pages, with torch's gather
and index_add_ around them. A measured call runs `--layers` layers of distinct weights in turn
(138 MB each at the default shape), so that the experts stream from memory as in a decode step
instead of staying in the L3 cache. Per token count: ms per layer of each (best of repeats, the
two alternating in this run), the ratio dense / fused (above 1: the fused op is faster), the
weight bytes of the experts routed to that the fused op streams per second, and whether the two
outputs are bit-equal (they should be).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: aserve
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common

from common import best_time  # noqa: E402


def dense_loop(w13: list, w2: list):
    """fn(x, topk_weights, topk_ids) over the experts' PackedWeights, one expert at a time."""
    import torch

    def run(x, topk_weights, topk_ids):
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in torch.unique(topk_ids).tolist():
            slot, token = torch.where(topk_ids.T == e)
            y = w2[e].linear(w13[e].silu_and_mul(x[token]))
            out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
        return out.to(x.dtype)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--int", type=int, choices=(4, 8), default=None,
                    help="also the experts as integers of these bits (groups of 32)")
    args = ap.parse_args()

    import torch

    from aserve.kernels import cpu_gemm
    from aserve.kernels.cpu_moe import CpuFusedMoE
    from aserve.kernels.cpu_qgemm import QuantFusedMoE
    from aserve.kernels.moe import select_experts
    from aserve.quantization.int_weights import IntWeight

    def int_experts(w: torch.Tensor, bits: int) -> list[IntWeight]:
        """Each expert's [N, K] rows quantized asymmetrically in groups of 32."""
        out = []
        for x in w.float():
            g = x.reshape(x.shape[0], -1, 32)
            low, high = g.amin(-1), g.amax(-1)
            scale = ((high - low) / (2**bits - 1)).clamp_min(1e-8)
            q = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 2**bits - 1)
            out.append(IntWeight(q.to(torch.uint8).reshape(x.shape), scale, low, 32, bits))
        return out

    if not cpu_gemm.available():
        print(json.dumps({"benchmark": "moe_kernel", "error": "no AVX512-BF16 build here"}))
        return 1
    h, i, e, k = args.hidden, args.intermediate, args.experts, args.top_k
    torch.manual_seed(0)
    kernels: dict[str, list] = {"fused": [], "dense": []}  # per layer: fn(x, weights, ids)
    for _ in range(args.layers):
        w13 = (torch.randn(e, 2 * i, h) * h**-0.5).bfloat16()
        w2 = (torch.randn(e, h, i) * i**-0.5).bfloat16()
        kernels["fused"].append(CpuFusedMoE(w13, w2))
        gate_up = [cpu_gemm.PackedWeight(w13[x], gated=True) for x in range(e)]
        down = [cpu_gemm.PackedWeight(w2[x]) for x in range(e)]
        cpu_gemm.gather_in_huge_pages([w for pair in zip(gate_up, down) for w in pair])
        kernels["dense"].append(dense_loop(gate_up, down))
        if args.int:
            moe = QuantFusedMoE(*(int_experts(w, args.int) for w in (w13, w2)))
            kernels.setdefault("int_fused", []).append(moe)
            kernels.setdefault("int_loop", []).append(moe.loop)
        del w13, w2
    expert_bytes = 2 * 3 * i * h
    report: dict = {"benchmark": "moe_kernel", "threads": torch.get_num_threads(),
                    "shape": {"hidden": h, "intermediate": i, "experts": e, "top_k": k,
                              "layers": args.layers}, "tokens": {}}
    with torch.inference_mode():
        for tokens in map(int, args.tokens.split(",")):
            weights, ids = select_experts(torch.randn(tokens, e), k, renormalize=True)
            inputs = (torch.randn(tokens, h).bfloat16(), weights, ids)
            ms = {name: float("inf") for name in kernels}
            for _ in range(3):  # alternate, so that a busy moment costs both alike
                for name, fns in kernels.items():
                    def step(fns=fns, a=inputs):
                        for fn in fns:
                            fn(*a)

                    seconds = best_time(step, min_repeats=3, budget_s=0.3)
                    ms[name] = min(ms[name], 1e3 * seconds / args.layers)
            routed = torch.unique(ids).numel()
            row = report["tokens"][str(tokens)] = {
                "fused_ms": round(ms["fused"], 3), "dense_ms": round(ms["dense"], 3),
                "ratio": round(ms["dense"] / ms["fused"], 2), "experts_routed": routed,
                "fused_weight_gb_per_s": round(routed * expert_bytes / ms["fused"] / 1e6, 1),
                "bit_equal": bool(torch.equal(kernels["fused"][0](*inputs),
                                              kernels["dense"][0](*inputs)))}
            if args.int:
                row.update({
                    "int_fused_ms": round(ms["int_fused"], 3),
                    "int_loop_ms": round(ms["int_loop"], 3),
                    "int_loop_over_fused": round(ms["int_loop"] / ms["int_fused"], 2),
                    "int_fused_over_bf16_fused": round(ms["int_fused"] / ms["fused"], 2),
                    "int_bit_equal": bool(torch.equal(kernels["int_fused"][0](*inputs),
                                                      kernels["int_loop"][0](*inputs)))})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
