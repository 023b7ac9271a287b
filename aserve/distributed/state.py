"""Tensor-parallel rank state read by the parallel layers.

With one rank this is rank 0 of a group of size 1 and the collectives below are no-ops.
`init_distributed` (comm.py) records a rank's place and process group through `set_tp`; layers
read the state when they are built, so it is set before the model is.
"""

from __future__ import annotations

from typing import Any

import torch

_tp_rank = 0
_tp_size = 1
_tp_group: Any = None  # a torch.distributed ProcessGroup once tensor parallelism exists


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def set_tp(rank: int, size: int, group: Any = None) -> None:
    """Record this process's tensor-parallel rank, group size and process group."""
    global _tp_rank, _tp_size, _tp_group
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} for size {size}.")
    _tp_rank, _tp_size, _tp_group = rank, size, group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place; identity when the group has one rank."""
    if _tp_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`; identity when the group has one rank."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)
