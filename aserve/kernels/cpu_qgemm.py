"""Weight-only int8 / int6 / int5 / int4 GEMM for CPUs with AVX512-VNNI (`csrc/qgemm.h`): the weight
stays in its integer form (`quantization.int_weights.IntWeight`: scale * q + min per group), packed
once at load into the bf16 GEMM's panels of 48 outputs, 4, 5, 6 or 8 bits a value plus an fp16 scale
and min per group and output (the scale alone for a symmetric weight: `symmetric_zero`), or, for
GGUF's K-quants, their own two levels (`two_levels`: int8 scales and mins a group under an fp16 pair
a block of 256 inputs); activations are quantized to int8 per row and group as each GEMM starts, and
`vpdpbusd` sums 64 products an instruction in exact int32 arithmetic.

A decode step streams every weight once, so its time is bytes / bandwidth: int4 streams about
a third of bf16's bytes (4 bits + 32 bits of scale and min a group of 32), int8 about half.

`reference` is the kernel's torch twin: the same activation quantization, bit for bit, and the
same integer sums, combined per group in float32 (the kernel fuses multiply-adds, so the two
agree to float32 rounding before the output's one bf16 rounding). CPUs with AVX2 but not
AVX512-VNNI and -BF16 run the same layouts by 8-wide tiles (`csrc/qgemm_avx2.h`: `vpmaddubsw`
pairs in int16, `vpmaddwd` into int32, the same integer sums; `isa()` "avx2"). Where the CPU
has neither (`available()` False), quantized weights are dequantized to bf16 at load instead
(`backends.cpu_ops`).
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_extension
from aserve.kernels.cpu_gemm import PackedGemm
from aserve.kernels.moe import apply_activation, local_slots
from aserve.quantization.int_weights import BLOCK, IntWeight, in_input_order


def _module():
    return cpu_extension.load()


def isa() -> str:
    """Which tiles run the integer GEMM here: "avx512" (AVX512-VNNI and -BF16), "avx2"
    (`csrc/qgemm_avx2.h`, the same layouts), or "" (none)."""
    module = _module()
    return "" if module is None else module.qgemm_isa()


def available() -> bool:
    """Whether quantized linears run here as integers (`QuantPackedWeight`), on either ISA."""
    return isa() != ""


def vnni() -> bool:
    """Whether this build has the AVX512-VNNI GEMM, which the MoE's one C++ call
    (`csrc/qmoe.h`) is built on."""
    return isa() == "avx512"


def storage_bits(bits: int, group: int) -> int:
    """The bits a packed value takes: 4 for values of up to 4 bits, 5 for 5 in groups of 32
    (Q5_0, Q5_1, Q5_K), 6 for 5 and 6 (Q6_K), else 8."""
    return 4 if bits <= 4 else 5 if bits == 5 and group == 32 else 6 if bits <= 6 else 8


def symmetric_zero(weight: IntWeight) -> int | None:
    """z where every group's min is exactly -z * scale, z a power of two of at most half the
    stored range (Q8_0: 128, Q4_0: 8, Q6_K: 32, Q5_0: 16, Q3_K: 4, GPTQ's symmetric 4 bits:
    8), also after both are rounded to fp16: the packed weight then keeps its scales alone,
    its values moved up to a zero of 2^(bits - 1). None: the mins are stored."""
    scale, low = weight.scale, weight.min
    nonzero = torch.nonzero(scale.reshape(-1))  # (a group of zeros has scale 0 and min 0)
    if len(nonzero) == 0:
        return None
    first = int(nonzero[0])
    zero = -float(low.reshape(-1)[first]) / float(scale.reshape(-1)[first])
    if not (zero >= 1 and zero.is_integer() and int(zero) & (int(zero) - 1) == 0
            and zero <= 2 ** (storage_bits(weight.bits, weight.group) - 1)):
        return None
    if not (torch.equal(low, -zero * scale)
            and torch.equal(low.half(), (-zero * scale.half().float()).half())):
        return None
    stored = 2 ** storage_bits(weight.bits, weight.group)
    if int(weight.q.max()) + stored // 2 - int(zero) >= stored:  # (moved up, it must fit)
        return None
    return int(zero)


def two_levels(weight: IntWeight, symmetric: bool) -> bool:
    """Whether the packed weight keeps `weight.blocks`' two levels (int8 sub-scales and
    sub-mins a group under an fp16 scale and min a block of 256 inputs) rather than an fp16
    scale and min a group: groups of 16 or 32, whole blocks, block scales that fp16 holds
    exactly, sub-mins unless symmetric."""
    blocks = weight.blocks
    if (blocks is None or weight.group not in (16, 32) or weight.shape[1] % BLOCK
            or weight.perm is not None or (blocks.sub_min is None and not symmetric)):
        return False
    parts = [blocks.scale] if symmetric else [blocks.scale, blocks.min]
    return all(bool(torch.isfinite(p).all()) and torch.equal(p.half().float(), p)
               for p in parts)


class QuantPackedWeight(PackedGemm):
    """An integer weight in the kernel's layout; `linear(x, bias)` applies it, as
    `cpu_gemm.PackedWeight` does a bf16 one (`gated`: [gate; up], for `silu_and_mul`)."""

    def __init__(self, weight: IntWeight, gated: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.gated, self.group = gated, weight.group
        self.bits = storage_bits(weight.bits, weight.group)
        self.perm = weight.perm  # act-order: the inputs of the packed columns, gathered first
        zero = symmetric_zero(weight)
        self.symmetric = zero is not None
        q = weight.q if zero is None else weight.q + (2 ** (self.bits - 1) - zero)
        self.two_levels = two_levels(weight, self.symmetric)
        if self.two_levels:
            blocks = weight.blocks
            self.data = _module().qgemm_pack(
                q.contiguous(), blocks.sub_scale,
                None if self.symmetric else blocks.sub_min, self.bits, gated,
                blocks.scale.half(), None if self.symmetric else blocks.min.half())
        else:
            self.data = _module().qgemm_pack(q.contiguous(), weight.scale.half(),
                                             None if self.symmetric else weight.min.half(),
                                             self.bits, gated, None, None)

    @staticmethod
    def supports(weight: IntWeight) -> bool:
        rows, cols = weight.shape
        return (weight.group % 16 == 0 and cols % weight.group == 0 and rows > 0
                and bool(torch.isfinite(weight.scale.half()).all())
                and bool(torch.isfinite(weight.min.half()).all()) and available())

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def quantization(self) -> str:
        """How it runs, as /v1/models says it: e.g. "int4 g32" ("int8 g32 sym": scales
        alone; "int4 g32/256": two levels, blocks of 256)."""
        return (f"int{self.bits} g{self.group}" + ("/256" if self.two_levels else "")
                + (" sym" if self.symmetric else ""))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of the weight (float32 [len(index), K], scale * q + min with the fp16 scale
        and min it stores), read back from the packed layout."""
        return in_input_order(
            _module().qgemm_rows(self.data, self.out_features, self.in_features, self.gated,
                                 index.reshape(-1).long()), self.perm)

    def _rows_in(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.contiguous() if self.perm is None else rows.index_select(1, self.perm)

    def _gemm(self, rows: torch.Tensor, bias: torch.Tensor | None, epilogue: int
              ) -> torch.Tensor:
        return _module().qgemm_linear(rows, self.data, self.out_features, bias, epilogue)


def quantize_activations(x: torch.Tensor, group: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq int8 [M, K], xs, xsum float32 [M, K / group]) as the kernel computes
    them: xq = round-half-even(x * (127 / amax)) per row and group (0 where amax is 0),
    xs = amax / 127, xsum = xs * sum(xq)."""
    rows, cols = x.shape
    xg = x.float().reshape(rows, cols // group, group)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = (xg * inv.unsqueeze(-1)).round().clamp(-128, 127)
    xs = amax / torch.tensor(127.0)
    xsum = xs * xq.sum(-1)
    return xq.to(torch.int8).reshape(rows, cols), xs, xsum


def reference(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None,
              two_levels: bool = False) -> torch.Tensor:
    """The kernel's float32 result for x [M, K] (before its bf16 rounding; bias added), with
    `weight`'s scale and min rounded to fp16 as the packed layout stores them, or (`two_levels`,
    as packed from `weight.blocks`) exact: block scale * sub-scale."""
    rows, cols = x.shape
    group, groups = weight.group, cols // weight.group
    if weight.perm is not None:  # act-order: the inputs gathered in the columns' order
        x = x.index_select(1, weight.perm)
    xq, xs, xsum = quantize_activations(x, group)
    q = weight.q.to(torch.int32).reshape(-1, groups, group)
    dots = torch.einsum("mgk,ngk->mgn", xq.to(torch.int32).reshape(rows, groups, group),
                        q).float()  # exact: |sum| < 2^31
    scale, low = weight.scale, weight.min
    if not two_levels:
        scale, low = scale.half().float(), low.half().float()
    acc = torch.zeros(rows, q.shape[0])
    for g in range(groups):
        acc = acc + (dots[:, g] * xs[:, g:g + 1]) * scale[:, g] + low[:, g] * xsum[:, g:g + 1]
    return acc if bias is None else acc + bias.float()


class QuantFusedMoE:
    """A MoE layer's experts kept as integers (`FusedMoEFn`): each local expert's [gate; up]
    packed gated and its down plain for the VNNI GEMM. SiLU-gated experts without biases or
    act-order, all packed alike, run in ONE C++ call (`csrc/qmoe.h`: every expert's packs
    stacked, the per-expert packs views of the stacks); the others run `fused_moe_ref`'s loop
    (experts in id order over their rows by slot then token, weighted rows summed in float32)
    with these GEMMs, the SiLU in the gated epilogue where there is no bias. The two are
    bit-equal where both apply."""

    packed = True  # the layer may drop its float copies

    def __init__(self, w13: list[IntWeight], w2: list[IntWeight], *, activation: str = "silu",
                 w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                 expert_map: torch.Tensor | None = None, alpha: float = 1.702,
                 limit: float | None = None) -> None:
        self.w13 = [QuantPackedWeight(w, gated=True) for w in w13]
        self.w2 = [QuantPackedWeight(w) for w in w2]
        self.w13_bias, self.w2_bias, self.expert_map = w13_bias, w2_bias, expert_map
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (w13, w2) [E, ...]
        if self._one_call():
            self.stacked = tuple(torch.stack([w.data for w in packs])
                                 for packs in (self.w13, self.w2))
            for stack, packs in zip(self.stacked, (self.w13, self.w2), strict=True):
                for e, w in enumerate(packs):
                    w.data = stack[e]  # (a view: the loop's packs take no memory of their own)
        self.map32 = (None if expert_map is None
                      else expert_map.to(torch.int32).contiguous())  # [E_global]

    def _one_call(self) -> bool:
        """Whether `csrc/qmoe.h` takes these experts."""
        return (vnni() and self.activation == "silu" and self.w13_bias is None
                and self.w2_bias is None
                and all(w.perm is None for w in (*self.w13, *self.w2))
                and all(len({w.data.shape for w in packs}) == 1
                        for packs in (self.w13, self.w2)))

    @staticmethod
    def supports(w13: list[IntWeight], w2: list[IntWeight]) -> bool:
        return bool(w13) and all(QuantPackedWeight.supports(w) for w in (*w13, *w2))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        if self.stacked is not None:
            return _module().qfused_moe(
                x, *self.stacked, topk_weights.to(torch.float32).contiguous(),
                topk_ids.to(torch.int64).contiguous(), self.map32, self.w2[0].in_features)
        return self.loop(x, topk_weights, topk_ids)

    def loop(self, x: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts one GEMM call each, in Python (x: contiguous bf16)."""
        local = local_slots(topk_ids, self.expert_map)  # [T, k]
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        for e in torch.unique(local[local >= 0]).tolist():
            slot, token = torch.where(local.T == e)  # by slot, then token
            rows = x[token]
            if self.w13_bias is None and self.activation == "silu":
                h = self.w13[e].silu_and_mul(rows)  # [n, I]
            else:
                h = self.w13[e].linear(rows)  # [n, 2I]: gate | up
                if self.w13_bias is not None:
                    h = h + self.w13_bias[e]
                h = apply_activation(h, self.activation, self.alpha, self.limit)
            y = self.w2[e].linear(h.contiguous(),
                                  None if self.w2_bias is None else self.w2_bias[e])
            out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
        return out.to(x.dtype)
