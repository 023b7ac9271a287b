"""aserve.distributed: rank state, collectives, process groups and the control channel."""

from __future__ import annotations

from aserve.distributed.comm import (
    DistributedConfig,
    broadcast_control,
    init_distributed,
    shutdown_distributed,
)
from aserve.distributed.state import (
    get_tp_rank,
    get_tp_size,
    set_tp,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "DistributedConfig", "broadcast_control", "get_tp_rank", "get_tp_size", "init_distributed",
    "set_tp", "shutdown_distributed", "tp_all_gather", "tp_all_reduce",
]
