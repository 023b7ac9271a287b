"""aserve.distributed: rank state, collectives, process groups and the control channel."""

from __future__ import annotations

from aserve.distributed.comm import (
    DistributedConfig,
    flush_sends,
    init_distributed,
    recv_control,
    recv_from_stage,
    send_control,
    send_to_first_rank,
    send_to_stage,
    shutdown_distributed,
)
from aserve.distributed.state import (
    expert_range,
    get_ep_rank,
    get_ep_size,
    get_moe_combine,
    get_pp_rank,
    get_pp_size,
    get_sp_rank,
    get_sp_size,
    get_tp_rank,
    get_tp_size,
    is_first_rank,
    set_ep,
    set_pp,
    set_sp,
    set_tp,
    single_rank,
    stage_layers,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "DistributedConfig", "expert_range", "flush_sends", "get_ep_rank", "get_ep_size",
    "get_moe_combine", "get_pp_rank", "get_pp_size", "get_sp_rank", "get_sp_size", "get_tp_rank",
    "get_tp_size", "init_distributed", "is_first_rank", "recv_control", "recv_from_stage",
    "send_control", "send_to_first_rank", "send_to_stage", "set_ep", "set_pp", "set_sp", "set_tp",
    "shutdown_distributed", "single_rank", "stage_layers", "tp_all_gather", "tp_all_reduce",
]
