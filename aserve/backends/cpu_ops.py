"""The CPU platform's kernels by dtype (`CpuPlatform.kernel_ops`), from aserve's C++ extension
(`aserve/kernels/csrc`, built once at start-up) where it applies:

    dtype     attention                 norms, RoPE,  linears               fused MoE    argmax
                                        gates
    float32   references (bit-equal HF) references    F.linear              reference    C++ scan
    bfloat16  C++ row tiles (AVX-512;   C++           aserve's AVX512-BF16  C++ over     C++ scan
              AVX2: float32 tasks),                   GEMM, else its AVX2   aserve's GEMM
              else C++ decode + SDPA                  tiles (no oneDNN      (AVX-512)
                                                      bf16), else oneDNN
    float16   C++ decode rows + SDPA    references    F.linear              reference    C++ scan

A bfloat16 model loaded from a quantized checkpoint (a GGUF's quant types) keeps its linear
weights as integers for the int4 / int8 GEMM (`cpu_qgemm`: AVX512-VNNI, else AVX2 tiles over
the same layouts), inside the same whole-layer calls where those run; without either, they are
dequantized to bf16 at load.

bfloat16 also has the whole decoder layer, and a stage's layers, as one C++ call (`cpu_block`;
AVX-512 or AVX2 builds).
Its fused MoE (`cpu_moe.CpuFusedMoE`) needs the AVX512-BF16 build and even H and I, else
`fused_moe_ref`.
Without a C++ compiler every op is its reference, and bfloat16 linears still get oneDNN's
packed GEMM.

Each wrapper here keeps the op's calling convention (`aserve.backends.ops`) for every input: what
its C++ kernel does not take (a non-contiguous tensor, int32 positions) goes to the reference.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from aserve.backends.cpu_block import CpuDecoderBlock, CpuDecoderStack
from aserve.backends.ops import (
    ExpertWeights,
    FusedMoEFn,
    KernelOps,
    LinearToPack,
    PackedLinear,
    fused_moe_ref_fn,
)
from aserve.kernels import cpu_elementwise, cpu_extension, cpu_gemm, cpu_qgemm
from aserve.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from aserve.kernels.cpu_attention import cpu_attention_forward
from aserve.kernels.cpu_gemm import PackedWeight, gather_in_huge_pages
from aserve.kernels.cpu_moe import CpuFusedMoE
from aserve.kernels.cpu_qgemm import QuantFusedMoE, QuantPackedWeight
from aserve.kernels.paged_attention_cpu import paged_attention_cpu
from aserve.kernels.rms_norm import rms_norm_ref
from aserve.kernels.rotary import rotary_ref
from aserve.kernels.store_kv import store_kv_ref
from aserve.quantization.int_weights import IntWeight

logger = logging.getLogger(__name__)

# Sampling on the host's cores: exponential draws and whole-vocabulary sorts are slow there,
# and reading a device value is free (`KernelOps.random_sampling`, `top_p_candidates`).
HOST_SAMPLING = {"random_sampling": "inverse_cdf", "top_p_candidates": 256}


def cpu_kernel_ops(dtype: torch.dtype) -> KernelOps:
    """The kernels for activations of `dtype` (builds the extension on first call)."""
    onednn = _pack_linears if dtype == torch.bfloat16 and _onednn_bf16() else None
    if cpu_extension.load() is None:
        return KernelOps("cpu-ref", pack_linears=onednn, **HOST_SAMPLING)
    if dtype == torch.float32:
        return KernelOps("cpu-fp32", argmax=cpu_elementwise.argmax, **HOST_SAMPLING)
    attention = {"store_kv": store_kv_ref, "paged_attention": paged_attention_cpu,
                 "attention_forward": cpu_attention_forward, "argmax": cpu_elementwise.argmax,
                 **HOST_SAMPLING}
    if dtype != torch.bfloat16:
        return KernelOps(f"cpu-{str(dtype).removeprefix('torch.')}", **attention)
    return KernelOps("cpu-bf16", **attention, rms_norm=rms_norm, rope=rope,
                     silu_and_mul=silu_and_mul, gelu_tanh_and_mul=gelu_tanh_and_mul,
                     pack_linears=_pack_linears,
                     decoder_layer=CpuDecoderBlock.of, decoder_stack=CpuDecoderStack.of,
                     fused_moe=fused_moe if cpu_gemm.available() else fused_moe_ref_fn)


def fused_moe(w: ExpertWeights) -> FusedMoEFn:
    """A quantized checkpoint's experts kept as integers for the VNNI GEMM
    (`cpu_qgemm.QuantFusedMoE`) where it takes them; else the experts packed for aserve's
    GEMM (`CpuFusedMoE`), or `fused_moe_ref` over `w`'s tensors where the kernel does not
    take them (odd H or I, weights not bf16)."""
    if w.quantized is not None and cpu_qgemm.available() and w.w13.dtype == torch.bfloat16:
        experts = w.quantized()
        if experts is not None and QuantFusedMoE.supports(*experts):
            return QuantFusedMoE(*experts, activation=w.activation, w13_bias=w.w13_bias,
                                 w2_bias=w.w2_bias, expert_map=w.expert_map, alpha=w.alpha,
                                 limit=w.limit)
    if not CpuFusedMoE.supports(w.w13, w.w2, w.w13_bias, w.w2_bias, w.activation):
        return fused_moe_ref_fn(w)
    return CpuFusedMoE(w.w13, w.w2, activation=w.activation, w13_bias=w.w13_bias,
                       w2_bias=w.w2_bias, expert_map=w.expert_map, alpha=w.alpha, limit=w.limit)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> None:
    """`rms_norm_ref`; contiguous rows in one C++ pass."""
    if x.is_contiguous() and (residual is None or residual.is_contiguous()):
        cpu_elementwise.rms_norm(x, weight, eps, residual)
    else:
        rms_norm_ref(x, weight, eps, residual)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor,
         sin: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    """`rotary_ref`; [T, H * D] rows with unit inner stride and int64 positions in C++, q and k
    in one pass where k's heads follow q's in each row (a split of the qkv projection)."""
    rows = (q,) if k is None else (q, k)
    if positions.dtype != torch.int64 or any(x.dim() != 2 or x.stride(1) != 1 for x in rows):
        rotary_ref(positions, q, k, cos, sin, head_dim, rotary_dim)
        return
    if k is not None and (k.data_ptr() == q.data_ptr() + q.shape[1] * q.element_size()
                          and k.stride() == q.stride() and q.stride(0) >= q.shape[1] + k.shape[1]):
        rows = (q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride()),)
    for x in rows:
        cpu_elementwise.rope(positions, x, cos, sin, head_dim, rotary_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_ref`; contiguous rows in one C++ pass."""
    if x.is_contiguous():
        return cpu_elementwise.silu_and_mul(x)
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh_and_mul_ref`; contiguous rows in one C++ pass."""
    if x.is_contiguous():
        return cpu_elementwise.gelu_tanh_and_mul(x)
    return gelu_tanh_and_mul_ref(x)


class OneDnnLinear:
    """A bf16 weight in oneDNN's prepacked layout (bit-equal to F.linear); never gated."""

    gated = False

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight, 64)  # 64: a batch hint

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float()

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("a oneDNN-packed weight is never gated")


def _onednn_bf16() -> bool:
    return (torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack_linears(weights: Sequence[LinearToPack]) -> list[PackedLinear | None]:
    """Each weight in aserve's GEMM layouts: a quantized checkpoint's in its integer form for
    the VNNI int4 / int8 GEMM (`QuantPackedWeight`) where the kernel takes it; bf16 weights
    in the AVX512-BF16 GEMM's (faster than oneDNN's at decode-sized batches, as fast at larger
    ones; `gated`: [gate; up] for a fused silu_and_mul), else oneDNN's; then aserve's, in
    forward order, into one buffer of huge pages. Other dtypes stay unpacked."""
    packed: list[PackedLinear | None] = []
    refused: Counter[str] = Counter()  # why integer weights went to bf16
    for weight, gated, quantized in weights:
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            packed.append(None)
        elif (int_weight := _int_weight(quantized, refused)) is not None:
            packed.append(QuantPackedWeight(int_weight, gated))
        elif PackedWeight.supports(weight) and not (cpu_gemm.isa() == "avx2" and _onednn_bf16()):
            # (AVX-512 CPUs without BF16 keep oneDNN's bf16 GEMM, not AVX2's tiles: unmeasured)
            packed.append(PackedWeight(weight, gated))
        else:
            packed.append(OneDnnLinear(weight) if _onednn_bf16() else None)
    gather_in_huge_pages([p for p in packed if isinstance(p, PackedWeight | QuantPackedWeight)])
    _log_quantized(packed)
    if refused:
        logger.warning("quantized weights the integer GEMM cannot take run dequantized to bf16: "
                       "%s", ", ".join(f"{n} ({why})" for why, n in sorted(refused.items())))
    return packed


def _int_weight(quantized: Callable[[], IntWeight | None] | None,
                refused: Counter[str]) -> IntWeight | None:
    """The integer form to pack, where there is one and the VNNI kernel takes it; why not
    counted in `refused` where a quantized weight has to run dequantized."""
    if quantized is None:
        return None
    if not cpu_qgemm.available():
        refused["no AVX512-VNNI or AVX2 build"] += 1
        return None
    weight = quantized()
    if weight is None:
        refused["a part stored as floats, or parts that do not stack"] += 1
        return None
    if not QuantPackedWeight.supports(weight):
        refused[f"groups of {weight.group} over {weight.shape[1]} inputs, or scales past "
                "fp16"] += 1
        return None
    return weight


def _log_quantized(packed: list[PackedLinear | None]) -> None:
    quantized = [p for p in packed if isinstance(p, QuantPackedWeight)]
    if not quantized:
        return
    kinds = Counter(p.quantization for p in quantized)
    logger.info("quantized GEMM (%s): %d of %d linear weights kept as integers (%s), "
                "%.1f MB; the rest bf16", cpu_qgemm.isa().upper(), len(quantized), len(packed),
                ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())),
                sum(p.nbytes for p in quantized) / 1e6)
