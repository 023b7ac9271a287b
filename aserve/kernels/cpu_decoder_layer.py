"""A pre-norm decoder layer (attention, then a gated-SiLU MLP: the Llama family's) in ONE C++
call on the CPU bf16 path (`csrc/decoder_layer.h`): the kernels the layer's modules would call
one by one from Python, called in the same order on the same tensors, so the result is
bit-identical and only the glue between them goes (module calls, splits, views, argument
checks; docs/benchmarks/throughput.md, "the decoder layer as one C++ call").

    decoder_layer(hidden, residual, positions, weights, plan, sizes, eps, scale, soft_cap)

    residual += hidden; x = norm(residual)      (first layer: residual = hidden; x = norm(hidden))
    qkv = x Wqkv^T (+ b); RoPE on q and k in place; K/V stored; attn = attention(q) over the cache
    o = attn Wo^T (+ b); residual += o; x = norm(residual)
    out = (silu(x Wgate^T) * (x Wup^T)) Wdown^T (+ b)              -> [out, residual]

`weights` / `plan` / `sizes` are lists in the orders of `WEIGHTS`, `PLAN` and `SIZES` below; an
absent bias is an empty tensor. The Python side that fills them from a layer's modules, and
falls back to them where this does not apply, is `aserve.backends.cpu_block`.
"""

from __future__ import annotations

# the list arguments of decoder_layer, in order
WEIGHTS = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
           "down_bias", "cos", "sin", "k_cache", "v_cache",
           # act-order (GPTQ): the inputs of each linear's packed columns, int64 (or empty)
           "qkv_perm", "o_perm", "gate_up_perm", "down_perm")
PLAN = ("block_table", "tiles", "slot_mapping")
SIZES = ("qkv_out", "o_out", "gate_up_out", "down_out", "num_heads", "num_kv_heads", "head_dim",
         "rotary_dim", "window", "rows")


