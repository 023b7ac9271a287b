"""Linear layers that know how tensor parallelism splits them.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`: it takes the FULL
checkpoint tensor, narrows it to this rank's part and copies it into the right slice, so loading
a checkpoint is a rename table plus these loaders. Weights are `[out_features, in_features]`.

```
ColumnParallelLinear      W split by rows (output features); no communication
MergedColumnParallel      [gate; up] packed, each part split by rows; shard_id = part index
QKVParallelLinear         [q; k; v] packed, split by heads; shard_id = "q" | "k" | "v"
RowParallelLinear         W split by columns (input features); all-reduce of the output
ReplicatedLinear          every rank holds all of W
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.backends.ops import PackedLinear
from aserve.distributed.state import get_tp_rank, get_tp_size, tp_all_reduce
from aserve.layers.bind import PackableLinear


def _param(*shape: int, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one) of the same shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, "
                         f"checkpoint {tuple(loaded.shape)}.")
    param.data.copy_(loaded)


def load_into(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
    """A checkpoint tensor into `param`: through the loader its layer hung on it
    (`param.weight_loader(param, loaded, shard_id)`: a shard of a packed or parallel layer), else
    a plain copy."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        default_weight_loader(param, loaded)
    else:
        loader(param, loaded, shard_id)


class LinearBase(PackableLinear):
    """`y = x W^T + b` with a [output_size, input_size] weight on this rank; once the platform
    has packed the weight (`aserve.layers.bind_ops`), its GEMM instead of F.linear."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = _param(output_size, input_size, loader=self.weight_loader)
        self.bias = _param(output_size, loader=self.weight_loader) if bias else None
        self.packed_weight: PackedLinear | None = None  # see `set_packed`

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return self.packed_weight.linear(x, bias)
        return F.linear(x, self.weight, bias)

    def set_packed(self, packed: PackedLinear) -> None:
        """Keep the weight only in the platform's packed layout (after loading)."""
        super().set_packed(packed)
        self.weight.data = self.weight.data.new_empty(0)  # the packed copy replaces it


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank i holds rows [i*out/tp, (i+1)*out/tp)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tp {tp_size}.")
        super().__init__(input_size, output_size // tp_size, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one weight (e.g. gate and up projections).

    `silu_gated`: [gate, up] of a SiLU MLP; the platform is asked to pack it gated, and where
    it does (aserve's CPU GEMM), `silu_and_mul(x)` applies the activation in the GEMM's
    epilogue.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 silu_gated: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        self.pack_gated = (silu_gated and not bias and len(self.output_sizes) == 2
                           and self.output_sizes[0] == self.output_sizes[1])

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up [T, d] out of the GEMM, where the weight is packed gated; else None
        (the caller applies its activation to `forward`'s [gate | up])."""
        if self.packed_weight is not None and self.packed_weight.gated:
            return self.packed_weight.silu_and_mul(x)
        return None

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"{type(self).__name__} needs an int shard id, got {shard_id!r}.")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        part = loaded.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections packed as [q heads | k heads | v heads], split over ranks by head.

    With more ranks than kv heads, each kv head is replicated on `tp_size / num_kv_heads` ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        if total_num_heads % tp_size:
            raise ValueError(f"{total_num_heads} heads are not divisible by tp {tp_size}.")
        self.head_dim = head_dim
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.num_kv_replicas = max(1, tp_size // total_num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias)

    def _shard(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in this rank's packed param, size, index of this rank's part)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_part = self.tp_rank // self.num_kv_replicas
        return {"q": (0, q_size, self.tp_rank), "k": (q_size, kv_size, kv_part),
                "v": (q_size + kv_size, kv_size, kv_part)}[shard_id]

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKVParallelLinear needs shard id 'q', 'k' or 'v', got {shard_id!r}.")
        offset, size, part = self._shard(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size),
                              loaded.narrow(0, part * size, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are summed by an all-reduce.

    The bias is added once, on rank 0, before the reduction. `reduce_results=False` leaves the
    partial sum to the caller (a MoE block sums its shared expert's with its experts' first).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        tp_size = get_tp_size()
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp {tp_size}.")
        super().__init__(input_size // tp_size, output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias: replicated
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self._linear(x, bias)  # [T, output], this rank's partial sum
        return tp_all_reduce(out) if self.reduce_results else out
