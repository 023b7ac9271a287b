"""Process groups and the control channel of a multi-rank engine.

    rank 0 (the process the user started)      ranks 1..N-1 (workers)
    scheduler, HTTP, engine thread             no scheduler: they loop on control messages
        │  send_control(RunStep(inputs)) ──────────► run the same forward on their shard
        │  collectives inside the model (all-reduce, all-gather) pair up rank by rank
        │  pipeline stages: hidden states sent stage to stage, logits back to rank 0

`init_distributed` joins the world through a TCP rendezvous (rank 0's address and port), makes
the tensor-parallel group (the whole world while pipeline parallelism is 1; also the expert-
parallel group under `--enable-expert-parallel`) and a gloo group for
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
from aserve.distributed.state import get_tp_rank, get_tp_size, set_ep, set_pp, set_tp

_control_group: Any = None
_pending: deque[tuple[Any, torch.Tensor]] = deque()  # sends in flight and their buffers


def init_distributed(config: DistributedConfig) -> None:
    """Join the process group and record this rank's tensor-parallel and pipeline place.

    Ranks are laid out stage-major: rank = stage * tp_size + tp_rank, so a stage's TP group is
    consecutive ranks (on one node when a node holds a whole stage).
    """
    global _control_group
    dist.init_process_group(
        config.backend, init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank, world_size=config.world_size,
        timeout=datetime.timedelta(seconds=config.timeout_s))
    world = dist.group.WORLD
    _control_group = world if config.backend == "gloo" else dist.new_group(backend="gloo")
    tp_size = config.tp_size or config.world_size
    pp_size = config.world_size // tp_size
    tp_group = world
    if pp_size > 1:  # every rank creates every group, in the same order
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
                  for s in range(pp_size)]
        tp_group = groups[config.rank // tp_size]
    set_tp(config.rank % tp_size, tp_size, tp_group)
    set_pp(config.rank // tp_size, pp_size, config.pp_layer_partition)
    if config.enable_expert_parallel:  # the EP group is the stage's TP group
        set_ep(config.rank % tp_size, tp_size, tp_group, config.moe_combine)


def _isend(tensor: torch.Tensor, peer: int, group: Any = None) -> None:
    """Send without waiting for the receiver; the buffer is kept until the send completes."""
    _pending.append((dist.isend(tensor, peer, group=group), tensor))
    while _pending and _pending[0][0].is_completed():
        _pending.popleft()


def send_to_stage(tensors: list[torch.Tensor], stage: int) -> None:
    """Send tensors to the rank of `stage` with this rank's TP index (hidden states onward,
    logits back), without waiting for them to be received."""
    peer = stage * get_tp_size() + get_tp_rank()
    for tensor in tensors:
        _isend(tensor.contiguous(), peer)


def recv_from_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                    stage: int) -> list[torch.Tensor]:
    """Receive tensors of these shapes from the rank of `stage` with this rank's TP index."""
    peer = stage * get_tp_size() + get_tp_rank()
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
    set_pp(0, 1)
    set_ep(0, 1, None)
