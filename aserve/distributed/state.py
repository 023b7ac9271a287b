"""Tensor-, sequence-, pipeline- and expert-parallel rank state read by the parallel layers.

With one rank this is rank 0 of a group of size 1 and the collectives below are no-ops.
`init_distributed` (comm.py) records a rank's place and process groups through `set_tp`,
`set_sp`, `set_pp` and `set_ep`; layers read the state when they are built, so it is set
before the model is.

Ranks are laid out `pp × sp × tp` (tp fastest): a stage holds sp × tp ranks; the ranks of one
SP rank are a TP group (the same tokens, the weights split), the ranks of one TP rank an SP
group (the same weight shard, the tokens split: `aserve/layers/ulysses.py`).

Expert parallelism (`--enable-expert-parallel`, vLLM's semantics) reuses a stage's TP ranks as
its EP group: attention stays tensor-parallel, and each MoE layer holds whole experts, rank r
those of `expert_range(E)` (E / ep each, the first E % ep ranks one more).
"""

from __future__ import annotations

from typing import Any

import torch

from aserve.config import MOE_COMBINES

_tp_rank = 0
_tp_size = 1
_tp_group: Any = None  # a torch.distributed ProcessGroup once tensor parallelism exists
_pp_rank = 0
_pp_size = 1
_pp_partition: tuple[int, ...] | None = None
_sp_rank = 0
_sp_size = 1
_sp_group: Any = None
_ep_rank = 0
_ep_size = 1
_ep_group: Any = None
_moe_combine = "all-reduce"


def get_pp_rank() -> int:
    """This rank's pipeline stage (0: embeds the tokens; pp_size - 1: computes the logits)."""
    return _pp_rank


def get_pp_size() -> int:
    return _pp_size


def set_pp(rank: int, size: int, partition: tuple[int, ...] | None = None) -> None:
    """Record this process's pipeline stage, the number of stages and, optionally, how many
    layers each stage runs (`--pp-layer-partition`)."""
    global _pp_rank, _pp_size, _pp_partition
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad pipeline stage {rank} for size {size}.")
    if partition is not None and (len(partition) != size or min(partition) < 1):
        raise ValueError(f"a layer partition needs {size} positive counts, got {partition}.")
    _pp_rank, _pp_size, _pp_partition = rank, size, partition


def stage_layers(num_layers: int, stage: int | None = None) -> range:
    """The decoder layers stage `stage` (default: this one) runs: the partition given, else an
    even split (earlier stages one fewer when the count does not divide)."""
    stage = _pp_rank if stage is None else stage
    if _pp_partition is not None:
        if sum(_pp_partition) != num_layers:
            raise ValueError(f"the layer partition {','.join(map(str, _pp_partition))} adds up "
                             f"to {sum(_pp_partition)}, but the model has {num_layers} layers.")
        start = sum(_pp_partition[:stage])
        return range(start, start + _pp_partition[stage])
    if num_layers < _pp_size:
        raise ValueError(f"{num_layers} layers cannot be split into {_pp_size} pipeline stages.")
    return range(stage * num_layers // _pp_size, (stage + 1) * num_layers // _pp_size)


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


def get_tp_group() -> Any:
    return _tp_group


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


def get_sp_rank() -> int:
    """This rank's place in its sequence-parallel group: it holds the step's rows
    [sp_rank * chunk, (sp_rank + 1) * chunk) outside attention."""
    return _sp_rank


def get_sp_size() -> int:
    """Ranks sharing a step's tokens (1: no sequence parallelism)."""
    return _sp_size


def get_sp_group() -> Any:
    return _sp_group


def set_sp(rank: int, size: int, group: Any = None) -> None:
    """Record this process's sequence-parallel rank, group size and process group."""
    global _sp_rank, _sp_size, _sp_group
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad sequence-parallel rank {rank} for size {size}.")
    _sp_rank, _sp_size, _sp_group = rank, size, group


def stage_rank() -> int:
    """This rank's index in its pipeline stage: sp_rank * tp_size + tp_rank."""
    return _sp_rank * _tp_size + _tp_rank


def get_ep_rank() -> int:
    return _ep_rank


def get_ep_size() -> int:
    """Ranks sharing a MoE layer's experts (1: no expert parallelism)."""
    return _ep_size


def get_ep_group() -> Any:
    return _ep_group


def get_moe_combine() -> str:
    """How expert outputs meet: "all-reduce" (every rank holds every token and sums its experts'
    share) or "all-to-all" (tokens split over the ranks, sent to their experts' ranks and back)."""
    return _moe_combine


def set_ep(rank: int, size: int, group: Any = None, combine: str = "all-reduce") -> None:
    """Record this process's expert-parallel rank, group size, process group and combine mode."""
    global _ep_rank, _ep_size, _ep_group, _moe_combine
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad expert-parallel rank {rank} for size {size}.")
    if combine not in MOE_COMBINES:
        raise ValueError(f"unknown MoE combine {combine!r}; known: {', '.join(MOE_COMBINES)}.")
    _ep_rank, _ep_size, _ep_group, _moe_combine = rank, size, group, combine


def expert_range(num_experts: int, rank: int | None = None, size: int | None = None) -> range:
    """The global ids of the experts EP rank `rank` (default: this one) holds: contiguous,
    num_experts // size each and one more on the first num_experts % size ranks."""
    rank = _ep_rank if rank is None else rank
    size = _ep_size if size is None else size
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
