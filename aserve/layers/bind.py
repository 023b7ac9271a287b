"""How layers get their kernels: every layer that runs one derives from `OpsLayer` and calls
them through `self.ops`, a `KernelOps` (`aserve.backends.ops`) that `bind_ops` sets once per
model: the runner binds its platform's choice for the model's dtype right after loading. A
layer not bound yet runs `REF_OPS`, the float32 torch references.

Binding also packs the linear weights, where the platform has a GEMM layout of its own
(`KernelOps.pack_linears`), all in one call and in forward order (with each weight's integer
form where the loader kept one from a quantized checkpoint, `quantization.int_weights`), and
prepares each `PreparedLayer` (a MoE layer's experts for `KernelOps.fused_moe`; a
`DecoderStack`'s layers for the platform's whole-layer calls, `backends.ops.fuse_layers`).
"""

from __future__ import annotations

from torch import nn

from aserve.backends.ops import REF_OPS, KernelOps, LinearToPack, PackedLinear
from aserve.quantization.int_weights import merged, release


class OpsLayer(nn.Module):
    """A layer that runs kernels: `self.ops` is the model's bound `KernelOps`."""

    ops: KernelOps = REF_OPS


class PackableLinear(OpsLayer):
    """A layer whose [out, in] `weight` may be packed: `pack_gated` says how it is asked for,
    `set_packed` takes what the platform returned (here: kept beside the weight; a layer that
    owns its weight alone drops it)."""

    pack_gated = False
    packed_weight: PackedLinear | None = None

    def set_packed(self, packed: PackedLinear) -> None:
        self.packed_weight = packed


class PreparedLayer(OpsLayer):
    """A layer that hands its loaded weights to its ops once they are bound (`prepare`), e.g.
    a MoE layer's experts to `ops.fused_moe`, which may pack them, or a decoder stack its
    layers to `fuse_layers`."""

    def prepare(self) -> None:
        """Called by `bind_ops` after `self.ops` is set (and after loading)."""


def bind_ops(model: nn.Module, ops: KernelOps) -> int:
    """Bind `ops` to every `OpsLayer` of `model`, prepare every `PreparedLayer` and pack the
    linear weights where `ops` packs; returns how many linear weights were packed."""
    for module in model.modules():
        if isinstance(module, OpsLayer):
            module.ops = ops
        if isinstance(module, PreparedLayer):
            module.prepare()
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    shared = {id(m.weight) for m in linears}
    # an embedding a quantized checkpoint holds as integers, not tied to a head: packed too,
    # where the platform's packed weight reads rows back (`use_packed_rows`)
    embeddings = [m for m in model.modules() if hasattr(m, "use_packed_rows")
                  and not isinstance(m, PackableLinear) and id(m.weight) not in shared
                  and merged(m.weight) is not None]
    if ops.pack_linears is None:
        for module in linears + embeddings:
            release(module.weight)
        return 0
    packed = ops.pack_linears([LinearToPack(m.weight.data, m.pack_gated, merged(m.weight))
                               for m in linears]
                              + [LinearToPack(m.weight.data, False, merged(m.weight))
                                 for m in embeddings])
    for module, weight in zip(linears + embeddings, packed, strict=True):
        release(module.weight)  # what the loader kept of a quantized checkpoint
        if weight is None:
            continue
        if module in embeddings:
            if hasattr(weight, "rows"):
                module.use_packed_rows(weight)
        else:
            module.set_packed(weight)
    return sum(weight is not None for weight in packed[:len(linears)])
