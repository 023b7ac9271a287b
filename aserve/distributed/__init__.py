"""aserve.distributed: tensor-parallel rank state and collectives (one rank for now)."""

from __future__ import annotations

from aserve.distributed.state import (
    get_tp_rank,
    get_tp_size,
    set_tp,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = ["get_tp_rank", "get_tp_size", "set_tp", "tp_all_gather", "tp_all_reduce"]
