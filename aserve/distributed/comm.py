"""Process groups and the control channel of a multi-rank engine.

    rank 0 (the process the user started)      ranks 1..N-1 (workers)
    scheduler, HTTP, engine thread             no scheduler: they loop on control messages
        │  send_control(RunStep(inputs)) ──────────► run the same forward on their shard
        │  collectives inside the model (all-reduce, all-gather) pair up rank by rank
        │  pipeline stages: hidden states sent stage to stage, logits back to rank 0

`init_distributed` joins the world through a TCP rendezvous (rank 0's address and port), makes
the tensor- and sequence-parallel groups (a stage's ranks of one SP / TP index; the expert-
parallel group under `--enable-expert-parallel` is the whole stage) and a gloo group for
control messages, so that they travel over host memory even when the model's collectives use
NCCL. Control messages are the frozen dataclasses of `aserve.executor.messages` (ints and numpy
arrays inside), pickled once per step, sent point to point without waiting for the receiver, so
that rank 0 can start the next batch of a pipeline while later stages still run the previous one.
"""

from __future__ import annotations

import datetime
import pickle
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from aserve.config import DistributedConfig
from aserve.distributed.state import (
    get_sp_size,
    get_tp_size,
    set_ep,
    set_pp,
    set_sp,
    set_tp,
    stage_rank,
)

_control_group: Any = None
_pending: deque[tuple[Any, torch.Tensor]] = deque()  # sends in flight and their buffers


def init_distributed(config: DistributedConfig) -> None:
    """Join the process group and record this rank's tensor-, sequence- and pipeline-parallel
    place.

    Ranks are laid out `pp × sp × tp`: rank = (stage * sp_size + sp_rank) * tp_size + tp_rank,
    so a TP group is consecutive ranks (on one node when a node holds a whole stage), and an
    SP group the ranks of one TP index in a stage.
    """
    global _control_group
    dist.init_process_group(
        config.backend, init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank, world_size=config.world_size,
        timeout=datetime.timedelta(seconds=config.timeout_s))
    world = dist.group.WORLD
    _control_group = world if config.backend == "gloo" else dist.new_group(backend="gloo")
    sp_size = config.sp_size
    tp_size = config.tp_size or config.world_size // sp_size
    stage_size = tp_size * sp_size
    pp_size = config.world_size // stage_size
    stage, in_stage = divmod(config.rank, stage_size)
    sp_rank, tp_rank = divmod(in_stage, tp_size)
    starts = [s * stage_size for s in range(pp_size)]  # every rank creates every group, in order
    tp_group = _my_group([[b + j * tp_size + t for t in range(tp_size)]
                          for b in starts for j in range(sp_size)], config)
    sp_group = _my_group([[b + j * tp_size + t for j in range(sp_size)]
                          for b in starts for t in range(tp_size)], config)
    set_tp(tp_rank, tp_size, tp_group)
    set_sp(sp_rank, sp_size, sp_group)
    set_pp(stage, pp_size, config.pp_layer_partition)
    if config.enable_expert_parallel:  # the EP group is the stage (its TP group without SP)
        stage_group = _my_group([list(range(b, b + stage_size)) for b in starts], config)
        set_ep(in_stage, stage_size, stage_group, config.moe_combine)


def _my_group(groups: list[list[int]], config: DistributedConfig) -> Any:
    """This rank's group of `groups` (a partition of the world, the same list on every rank):
    the world itself when it is one group, None when groups have one rank (nothing to
    exchange), else a new group, every one of them created on every rank."""
    if len(groups) == 1:
        return dist.group.WORLD
    if len(groups[0]) == 1:
        return None
    made = [dist.new_group(ranks) for ranks in groups]
    return next(g for g, ranks in zip(made, groups, strict=True) if config.rank in ranks)


def _stage_peer(stage: int) -> int:
    """The rank of `stage` at this rank's place in its stage."""
    return stage * get_sp_size() * get_tp_size() + stage_rank()


def _isend(tensor: torch.Tensor, peer: int, group: Any = None) -> None:
    """Send without waiting for the receiver; the buffer is kept until the send completes."""
    _pending.append((dist.isend(tensor, peer, group=group), tensor))
    while _pending and _pending[0][0].is_completed():
        _pending.popleft()


def send_to_stage(tensors: list[torch.Tensor], stage: int) -> None:
    """Send tensors to the rank of `stage` at this rank's place (hidden states onward,
    logits back), without waiting for them to be received."""
    peer = _stage_peer(stage)
    for tensor in tensors:
        _isend(tensor.contiguous(), peer)


def recv_from_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                    stage: int) -> list[torch.Tensor]:
    """Receive tensors of these shapes from the rank of `stage` at this rank's place."""
    peer = _stage_peer(stage)
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    for tensor in tensors:
        dist.recv(tensor, peer)
    return tensors


def _send_pickled(message: Any, ranks: range | list[int]) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(message, protocol=5)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    for rank in ranks:
        _isend(size, rank, _control_group)
        _isend(payload, rank, _control_group)


def send_control(message: Any) -> None:
    """Rank 0: send `message` to every other rank, in order, without waiting for them."""
    _send_pickled(message, range(1, dist.get_world_size()))


def send_to_first_rank(message: Any) -> None:
    """Ranks > 0: send `message` to rank 0 (a report it waits for), without waiting."""
    _send_pickled(message, [0])


def recv_control(src: int = 0) -> Any:
    """The next control message from rank `src`: ranks > 0 receive rank 0's; rank 0 the
    reports of the others."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=_control_group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=_control_group)
    return pickle.loads(payload.numpy().tobytes())


def flush_sends(timeout_s: float = 10.0) -> bool:
    """Wait until every send in flight has been received; False if one did not in time."""
    try:
        while _pending:
            _pending[0][0].wait(datetime.timedelta(seconds=timeout_s))
            _pending.popleft()
    except RuntimeError:  # a peer is gone or too slow
        return False
    return True


def shutdown_distributed() -> None:
    """Leave the process group (if joined) and go back to one rank."""
    global _control_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None
    _pending.clear()
    set_tp(0, 1, None)
    set_sp(0, 1, None)
    set_pp(0, 1)
    set_ep(0, 1, None)
