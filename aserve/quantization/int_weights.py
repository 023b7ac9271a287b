"""A quantized weight in the one integer form every quantized kernel takes:

    W[n, k] = scale[n, k // group] * q[n, k] + min[n, k // group],    0 <= q < 2 ** bits

with, for GPTQ's act-order, the columns in a permuted order (`perm`: column k of q is input
perm[k], so that each group is a run of consecutive columns; a kernel reads x[:, perm]).
GGUF's K-quants also say how their scales were stored (`SuperBlocks`: an fp16 scale and min a
block of 256 inputs times small integers a group), which a kernel may keep instead of a float
scale a group.

Every GGUF quant type (`gguf_quants.int_weight`), AWQ and GPTQ without act-order
(`min = -scale * zero`) and compressed-tensors' int checkpoints are exactly this. The loader keeps,
beside each float weight it dequantized, how to get its integer form (`attach` / `merged`), so
that a platform with integer kernels packs the weight from it and never re-quantizes a float.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import gcd

import torch

SHARDS = "quantized_shards"  # the attribute `attach` sets on a parameter


BLOCK = 256  # inputs of a super-block


@dataclass(frozen=True)
class SuperBlocks:
    """The two levels of GGUF's K-quants: scale = block scale * sub-scale and min = block min *
    sub-min per group, both products exact in float32 (the block's are fp16 values)."""

    sub_scale: torch.Tensor  # int8 [rows, cols // group]
    sub_min: torch.Tensor | None  # int8 [rows, cols // group]; None: the mins are -z * scale
    scale: torch.Tensor  # float32 [rows, cols // BLOCK]
    min: torch.Tensor | None  # float32 [rows, cols // BLOCK]
    zero: int = 0  # symmetric (no sub-mins): min = -zero * scale

    def rows(self, index: torch.Tensor) -> SuperBlocks:
        return SuperBlocks(self.sub_scale[index],
                           None if self.sub_min is None else self.sub_min[index],
                           self.scale[index], None if self.min is None else self.min[index],
                           self.zero)

    def with_mins(self) -> SuperBlocks | None:
        """The same blocks with their mins stored (-zero * scale = (-zero * block scale) *
        sub-scale); None for symmetric blocks that do not say their zero."""
        if self.sub_min is not None:
            return self
        if self.zero <= 0:
            return None
        return SuperBlocks(self.sub_scale, self.sub_scale, self.scale, -self.zero * self.scale)

    def regroup(self, times: int) -> SuperBlocks:
        """The same blocks over groups `times` finer."""
        def repeat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.repeat_interleave(times, dim=1)
        return SuperBlocks(repeat(self.sub_scale), repeat(self.sub_min), self.scale, self.min,
                           self.zero)

    @staticmethod
    def concat(parts: Sequence[SuperBlocks | None]) -> SuperBlocks | None:
        """Parts stacked by rows (one group size), or None where any has none. Symmetric parts
        beside parts with mins (Q4_K_M's Q6_K v beside its Q4_K q and k) store mins too."""
        if any(p is None for p in parts):
            return None
        zeros = {p.zero if p.sub_min is None else -1 for p in parts}
        if len(zeros) > 1:
            parts = [p.with_mins() for p in parts]
            if any(p is None for p in parts):
                return None
        sym = parts[0].sub_min is None
        return SuperBlocks(torch.cat([p.sub_scale for p in parts]),
                           None if sym else torch.cat([p.sub_min for p in parts]),
                           torch.cat([p.scale for p in parts]),
                           None if sym else torch.cat([p.min for p in parts]),
                           parts[0].zero if sym else 0)


@dataclass(frozen=True)
class IntWeight:
    q: torch.Tensor  # uint8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols // group]
    min: torch.Tensor  # float32 [rows, cols // group]
    group: int
    bits: int  # of a value: 2..8
    perm: torch.Tensor | None = None  # int64 [cols]: the input of each column (None: k)
    blocks: SuperBlocks | None = None  # GGUF's K-quants: how scale and min were stored

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, its columns in input order."""
        rows, cols = self.q.shape
        q = self.q.float().view(rows, cols // self.group, self.group)
        w = (q * self.scale.unsqueeze(-1) + self.min.unsqueeze(-1)).view(rows, cols)
        return in_input_order(w, self.perm)

    def regroup(self, group: int) -> IntWeight:
        """The same weight with groups of `group` (a divisor of this one's): scales repeated."""
        if group == self.group:
            return self
        assert self.group % group == 0, (self.group, group)
        times = self.group // group
        return IntWeight(self.q, self.scale.repeat_interleave(times, dim=1),
                         self.min.repeat_interleave(times, dim=1), group, self.bits, self.perm,
                         None if self.blocks is None else self.blocks.regroup(times))

    def rows(self, index: torch.Tensor) -> IntWeight:
        """The weight with its rows reordered (`index`: the new order)."""
        return IntWeight(self.q[index], self.scale[index], self.min[index], self.group,
                         self.bits, self.perm,
                         None if self.blocks is None else self.blocks.rows(index))

    @staticmethod
    def concat(parts: Sequence[IntWeight]) -> IntWeight:
        """Parts stacked by rows (q; k; v or gate; up), in the finest group and most bits any
        part has; ValueError where their columns (or column orders) differ or no group fits
        them all."""
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1:
            raise ValueError(f"parts of {sorted(cols)} columns")
        perm = parts[0].perm
        if any((p.perm is None) != (perm is None) or (perm is not None and not torch.equal(
                p.perm, perm)) for p in parts):
            raise ValueError("parts whose columns are in different orders")
        group = 0
        for p in parts:
            group = gcd(group, p.group)
        if group % 16:
            raise ValueError(f"groups {[p.group for p in parts]} share no multiple of 16")
        parts = [p.regroup(group) for p in parts]
        return IntWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                         torch.cat([p.min for p in parts]), group, max(p.bits for p in parts),
                         perm, SuperBlocks.concat([p.blocks for p in parts]))


def in_input_order(columns: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """[rows, K] values whose column j is input perm[j], put in input order (None: as is)."""
    if perm is None:
        return columns
    out = torch.empty_like(columns)
    out[:, perm] = columns
    return out


Source = Callable[[], "IntWeight | None"]  # reads a shard's integer form when asked


def attach(param: torch.nn.Parameter, shard_id: str | int | None, source: Source) -> None:
    """Record where the integer form of `param`'s shard `shard_id` comes from."""
    shards = getattr(param, SHARDS, None)
    if shards is None:
        shards = {}
        setattr(param, SHARDS, shards)
    shards[shard_id] = source


def merged(param: torch.nn.Parameter) -> Callable[[], IntWeight | None] | None:
    """How to read `param`'s whole integer form (its shards in row order: q, k, v; 0, 1, ...),
    or None where the loader recorded none. The reader returns None where a shard has no
    integer form (a float tensor) or the parts do not stack."""
    shards = getattr(param, SHARDS, None)
    if not shards:
        return None
    if set(shards) <= {"q", "k", "v"}:
        order = [s for s in ("q", "k", "v") if s in shards]
    else:
        order = sorted(shards, key=lambda s: -1 if s is None else s)

    def read() -> IntWeight | None:
        parts = [shards[s]() for s in order]
        if any(p is None for p in parts):
            return None
        try:
            whole = parts[0] if len(parts) == 1 else IntWeight.concat(parts)
        except ValueError:
            return None
        return whole if tuple(whole.shape) == tuple(param.shape) else None

    return read


def experts(w13: torch.nn.Parameter, w2: torch.nn.Parameter, local: range
            ) -> Callable[[], tuple[list[IntWeight], list[IntWeight]] | None] | None:
    """How to read a MoE layer's experts' integer forms (the loader's sources under (kind,
    expert)): per local expert its [gate; up] and its down weight; None where any is missing
    (a fused checkpoint tensor, a float type)."""
    up, down = getattr(w13, SHARDS, None) or {}, getattr(w2, SHARDS, None) or {}
    needed = ([("gate", e) for e in local] + [("up", e) for e in local], [("down", e)
                                                                        for e in local])
    if not all(k in up for k in needed[0]) or not all(k in down for k in needed[1]):
        return None

    def read() -> tuple[list[IntWeight], list[IntWeight]] | None:
        w13_parts, w2_parts = [], []
        for e in local:
            gate, upper, lower = up[("gate", e)](), up[("up", e)](), down[("down", e)]()
            if gate is None or upper is None or lower is None:
                return None
            try:
                w13_parts.append(IntWeight.concat([gate, upper]))
            except ValueError:
                return None
            w2_parts.append(lower)
        return w13_parts, w2_parts

    return read


def release(param: torch.nn.Parameter) -> None:
    """Forget the recorded sources (what they hold open goes with them)."""
    if hasattr(param, SHARDS):
        delattr(param, SHARDS)
