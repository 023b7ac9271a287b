"""The matmul-bound limit of a workload on this machine: how many output tokens/s an engine
would reach if a step cost nothing but its linear layers' GEMMs, timed here with torch.

    python benchmarks/matmul_limit.py --model DIR -n 64 -i 128 -o 128 [--decode-batch 64]

For a Llama-family model (fused q/k/v and gate/up projections, as an engine runs them) and a
workload of N requests x I prompt / O output tokens, decoded B at a time, prefilled M tokens
per step:

    T_min = (N*I / M) * L * t_layer(M)  +  (N / B) * ((O - 1) * t_step(B) + t_head(B))
    limit = N*O / T_min       output tokens/s

where t_layer(m) is the time of one layer's GEMMs on m rows (qkv, o, gate_up, down; all L
layers have the same shapes), t_head(m) that of the LM head, and t_step(m) = L * t_layer(m) +
t_head(m): one decode step. The first output token of a request comes with its prefill (one
LM-head row). Attention, norms, sampling and all overhead are left out, so no engine reaches
it: it is a ceiling to report figures against. Each time is the best of several repeats.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from common import best_time


@dataclass(frozen=True)
class LinearShapes:
    """The (in_features, out_features) of the GEMMs of one decoder layer, and of the LM head."""

    num_layers: int
    layer: tuple[tuple[int, int], ...]
    head: tuple[int, int]

    @classmethod
    def from_config(cls, model_dir: str | Path) -> LinearShapes:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        h, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        head_dim = c.get("head_dim") or h // heads
        layer = ((h, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, h),
                 (h, 2 * c["intermediate_size"]), (c["intermediate_size"], h))
        return cls(c["num_hidden_layers"], layer, (h, c["vocab_size"]))

    def flops(self, rows: int, with_layers: bool = True, with_head: bool = True) -> float:
        layer = sum(2 * k * n for k, n in self.layer) * self.num_layers if with_layers else 0
        return rows * (layer + (2 * self.head[0] * self.head[1] if with_head else 0))


def time_gemms(shapes: tuple[tuple[int, int], ...], rows: int, min_repeats: int = 5,
               budget_s: float = 0.5) -> float:
    """Best seconds for one pass of bf16 GEMMs [rows, k] @ [k, n] over `shapes` (`best_time`:
    small GEMMs on a busy machine stall on their threads' barriers now and then)."""
    import torch

    with torch.inference_mode():
        pairs = [(torch.randn(rows, k, dtype=torch.bfloat16),
                  torch.randn(n, k, dtype=torch.bfloat16)) for k, n in shapes]
        for x, w in pairs:  # a second warm-up pass; best_time makes the first
            torch.nn.functional.linear(x, w)

        def one_pass() -> None:
            for x, w in pairs:
                torch.nn.functional.linear(x, w)

        return best_time(one_pass, min_repeats, budget_s)


def matmul_limit(shapes: LinearShapes, num_requests: int, input_len: int, output_len: int,
                 decode_batch: int, prefill_tokens: int = 4096) -> dict:
    """The docstring's formula, with its GEMM times measured now; output tok/s and the rates."""
    b = max(1, min(decode_batch, num_requests))
    m = max(1, min(prefill_tokens, num_requests * input_len))
    t_layer_prefill = time_gemms(shapes.layer, m)
    t_layer_decode = time_gemms(shapes.layer, b)
    t_head = time_gemms((shapes.head,), b)
    t_step = shapes.num_layers * t_layer_decode + t_head
    t_min = (num_requests * input_len / m * shapes.num_layers * t_layer_prefill
             + num_requests / b * ((output_len - 1) * t_step + t_head))
    return {
        "limit_output_tokens_per_s": round(num_requests * output_len / t_min, 1),
        "limit_s": round(t_min, 3),
        "prefill_rows": m, "decode_batch": b,
        "prefill_tflops": round(shapes.flops(m, with_head=False)
                                / (shapes.num_layers * t_layer_prefill) / 1e12, 3),
        "decode_tflops": round(shapes.flops(b) / t_step / 1e12, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (its config.json)")
    ap.add_argument("-n", "--num-prompts", type=int, default=64)
    ap.add_argument("-i", "--input-len", type=int, default=128)
    ap.add_argument("-o", "--output-len", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=256, help="capped at --num-prompts")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="prefill rows per step")
    args = ap.parse_args()
    shapes = LinearShapes.from_config(args.model)
    print(json.dumps(matmul_limit(shapes, args.num_prompts, args.input_len, args.output_len,
                                  args.decode_batch, args.prefill_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
