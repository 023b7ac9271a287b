"""Tensor-, sequence-, pipeline- and expert-parallel rank state read by the parallel layers.

With one rank this is rank 0 of a group of size 1 and the collectives below are no-ops.
`init_distributed` (comm.py) records a rank's place and process groups through `set_tp`,
`set_sp`, `set_pp` and `set_ep`; layers read the state when they are built, so it is set
before the model is. Inside `single_rank()` a thread sees the place of a rank alone (a model
rank 0 builds and runs whole for every rank: speculative decoding's draft model or head).

Ranks are laid out `pp × sp × tp` (tp fastest): a stage holds sp × tp ranks; the ranks of one
SP rank are a TP group (the same tokens, the weights split), the ranks of one TP rank an SP
group (the same weight shard, the tokens split: `aserve/layers/ulysses.py`).

Expert parallelism (`--enable-expert-parallel`, vLLM's semantics) reuses a stage's TP ranks as
its EP group: attention stays tensor-parallel, and each MoE layer holds whole experts, rank r
those of `expert_range(E)` (E / ep each, the first E % ep ranks one more).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from aserve.config import MOE_COMBINES


@dataclass(frozen=True)
class _Place:
    """A rank's place in its groups (the defaults: one rank alone)."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # a torch.distributed ProcessGroup once tensor parallelism exists
    pp_rank: int = 0
    pp_size: int = 1
    pp_partition: tuple[int, ...] | None = None
    sp_rank: int = 0
    sp_size: int = 1
    sp_group: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    moe_combine: str = "all-reduce"


_ALONE = _Place()
_process_place = _ALONE  # this process's, set by init_distributed
_thread = threading.local()  # .alone: this thread runs a model of its own (`single_rank`)


def _place() -> _Place:
    return _ALONE if getattr(_thread, "alone", False) else _process_place


def _set(**fields: Any) -> None:
    global _process_place
    _process_place = replace(_process_place, **fields)


def get_pp_rank() -> int:
    """This rank's pipeline stage (0: embeds the tokens; pp_size - 1: computes the logits)."""
    return _place().pp_rank


def get_pp_size() -> int:
    return _place().pp_size


def set_pp(rank: int, size: int, partition: tuple[int, ...] | None = None) -> None:
    """Record this process's pipeline stage, the number of stages and, optionally, how many
    layers each stage runs (`--pp-layer-partition`)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad pipeline stage {rank} for size {size}.")
    if partition is not None and (len(partition) != size or min(partition) < 1):
        raise ValueError(f"a layer partition needs {size} positive counts, got {partition}.")
    _set(pp_rank=rank, pp_size=size, pp_partition=partition)


def stage_layers(num_layers: int, stage: int | None = None) -> range:
    """The decoder layers stage `stage` (default: this one) runs: the partition given, else an
    even split (earlier stages one fewer when the count does not divide)."""
    place = _place()
    stage = place.pp_rank if stage is None else stage
    if place.pp_partition is not None:
        partition = place.pp_partition
        if sum(partition) != num_layers:
            raise ValueError(f"the layer partition {','.join(map(str, partition))} adds up to "
                             f"{sum(partition)}, but the model has {num_layers} layers.")
        start = sum(partition[:stage])
        return range(start, start + partition[stage])
    size = place.pp_size
    if num_layers < size:
        raise ValueError(f"{num_layers} layers cannot be split into {size} pipeline stages.")
    return range(stage * num_layers // size, (stage + 1) * num_layers // size)


def get_tp_rank() -> int:
    return _place().tp_rank


def get_tp_size() -> int:
    return _place().tp_size


def set_tp(rank: int, size: int, group: Any = None) -> None:
    """Record this process's tensor-parallel rank, group size and process group."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} for size {size}.")
    _set(tp_rank=rank, tp_size=size, tp_group=group)


def get_tp_group() -> Any:
    return _place().tp_group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place; identity when the group has one rank."""
    place = _place()
    if place.tp_size == 1:
        return x
    torch.distributed.all_reduce(x, group=place.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`; identity when the group has one rank."""
    place = _place()
    if place.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(place.tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=place.tp_group)
    return torch.cat(parts, dim=dim)


def get_sp_rank() -> int:
    """This rank's place in its sequence-parallel group: it holds the step's rows
    [sp_rank * chunk, (sp_rank + 1) * chunk) outside attention."""
    return _place().sp_rank


def get_sp_size() -> int:
    """Ranks sharing a step's tokens (1: no sequence parallelism)."""
    return _place().sp_size


def get_sp_group() -> Any:
    return _place().sp_group


def set_sp(rank: int, size: int, group: Any = None) -> None:
    """Record this process's sequence-parallel rank, group size and process group."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad sequence-parallel rank {rank} for size {size}.")
    _set(sp_rank=rank, sp_size=size, sp_group=group)


def stage_rank() -> int:
    """This rank's index in its pipeline stage: sp_rank * tp_size + tp_rank."""
    place = _place()
    return place.sp_rank * place.tp_size + place.tp_rank


def get_ep_rank() -> int:
    return _place().ep_rank


def get_ep_size() -> int:
    """Ranks sharing a MoE layer's experts (1: no expert parallelism)."""
    return _place().ep_size


def get_ep_group() -> Any:
    return _place().ep_group


def get_moe_combine() -> str:
    """How expert outputs meet: "all-reduce" (every rank holds every token and sums its experts'
    share) or "all-to-all" (tokens split over the ranks, sent to their experts' ranks and back)."""
    return _place().moe_combine


def set_ep(rank: int, size: int, group: Any = None, combine: str = "all-reduce") -> None:
    """Record this process's expert-parallel rank, group size, process group and combine mode."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad expert-parallel rank {rank} for size {size}.")
    if combine not in MOE_COMBINES:
        raise ValueError(f"unknown MoE combine {combine!r}; known: {', '.join(MOE_COMBINES)}.")
    _set(ep_rank=rank, ep_size=size, ep_group=group, moe_combine=combine)


def is_first_rank() -> bool:
    """Whether this is rank 0 of every group (the rank that samples), one rank included."""
    place = _place()
    return place.tp_rank == place.pp_rank == place.sp_rank == place.ep_rank == 0


@contextmanager
def single_rank() -> Iterator[None]:
    """Build or run a model of this rank alone, as if it were the only one: no split weights,
    no stages, no collectives (speculative decoding's draft model or EAGLE head, which rank 0
    runs whole for every rank: `runner/spec_draft.py`), in this thread only: another thread
of the process (the next pipelined step's) keeps the rank's _place()."""
    alone = getattr(_thread, "alone", False)
    _thread.alone = True
    try:
        yield
    finally:
        _thread.alone = alone


def expert_range(num_experts: int, rank: int | None = None, size: int | None = None) -> range:
    """The global ids of the experts EP rank `rank` (default: this one) holds: contiguous,
    num_experts // size each and one more on the first num_experts % size ranks."""
    place = _place()
    rank = place.ep_rank if rank is None else rank
    size = place.ep_size if size is None else size
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
