"""A P2P consumer rank's worker side (`Puller`): it loads the blocks its scheduler's pulls name,
each from the producer rank its (signed) params name, and reports each load done or failed.

    start_load_kv ─ submit(pull) ─► address allowed? ─► that address' queue ─► its thread:
                    (deadline: now + pull_timeout_s)     connect (or reuse) → ask → check the
                                                         reply's shapes and dtype → recv → commit
    take_finished ─ (recving, failed); a pull past its deadline fails there, whatever its
                    thread is doing: the blocks it would have written are never written

One thread, queue and connection per producer address (at most the allow-list's length, or
`MAX_PRODUCERS`), so a slow or stalled producer delays only the pulls from itself, and each of
those at most `pull_timeout_s`. A pull is committed (its blocks written) only before its
deadline, under the lock the deadline check takes: a failed load's blocks, which the scheduler
frees at once, are never written late. Nothing a peer sends is trusted: its reply's shapes and
dtype must be exactly this rank's layout for the blocks asked before anything is allocated.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from aserve.kv_transfer.base import PagedKV
from aserve.kv_transfer.p2p_auth import format_address, is_allowed
from aserve.kv_transfer.p2p_wire import Peer, seconds, write_line

logger = logging.getLogger(__name__)

MAX_PRODUCERS = 64  # producer addresses one consumer rank pulls from, without an allow-list

Address = tuple[str, int]


@dataclass(frozen=True)
class Pull:
    """Blocks a consumer loads: per group, the producer's ids and its own, pairwise.
    `error`: why the load cannot happen (it fails at once, and is recomputed)."""

    req_id: str
    host: str
    port: int
    handle: str
    remote_ids: tuple[tuple[int, ...], ...]
    local_ids: tuple[tuple[int, ...], ...]
    error: str | None = None


class _State(enum.Enum):
    PENDING = 0  # its deadline counts
    COMMITTED = 1  # its blocks are being written: it can no longer fail by its deadline
    DONE = 2
    FAILED = 3


@dataclass
class _Load:
    """One pull on its way (its state changes under the `Puller`'s lock)."""

    pull: Pull
    deadline: float
    start: float = field(default_factory=time.perf_counter)
    state: _State = _State.PENDING


class Puller:
    """See the module docstring. `timeouts`: the connector's (`connect_timeout_s`,
    `transfer_timeout_s`, `pull_timeout_s`); `producers`: the allowed (host, port) pairs
    (None: any)."""

    def __init__(self, paged: PagedKV, kv_cache_key: str, tp_rank: int, secret: bytes,
                 timeouts: dict[str, float], producers: frozenset[Address] | None) -> None:
        self.paged, self.kv_cache_key, self.tp_rank = paged, kv_cache_key, tp_rank
        self.secret, self.timeouts, self.producers = secret, timeouts, producers
        self._lock = threading.Lock()
        self._queues: dict[Address, queue.SimpleQueue[_Load | None]] = {}
        self._peers: dict[Address, Peer] = {}
        self._loads: dict[str, _Load] = {}  # by request id, while pending
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._num_bytes, self._seconds = 0, 0.0

    def submit(self, pull: Pull) -> None:
        load = _Load(pull, time.monotonic() + self.timeouts["pull_timeout_s"])
        address = (pull.host, pull.port)
        error = pull.error or self._address_error(address)
        with self._lock:
            work = self._queue_for(address) if error is None else None
            if work is not None:
                self._loads[pull.req_id] = load
        if work is None:
            self._fail(load, error or f"more than {MAX_PRODUCERS} producer addresses")
        else:
            work.put(load)

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(loaded, failed) since the last call; pulls past their deadline fail here."""
        now = time.monotonic()
        with self._lock:
            late = [load for load in self._loads.values() if load.deadline < now]
        for load in late:
            self._fail(load, f"no answer within pull_timeout_s "
                             f"({self.timeouts['pull_timeout_s']:g} s)")
        with self._lock:
            recving, self._recving = self._recving, set()
            failed, self._failed = self._failed, set()
        return recving, failed

    def take_stats(self) -> tuple[int, float]:
        with self._lock:
            stats = (self._num_bytes, self._seconds)
            self._num_bytes, self._seconds = 0, 0.0
        return stats

    def peers(self) -> list[Peer]:
        with self._lock:
            return list(self._peers.values())

    def shutdown(self) -> None:
        with self._lock:
            queues, peers = list(self._queues.values()), list(self._peers.values())
        for work in queues:
            work.put(None)
        for peer in peers:
            peer.close()

    # ---------------------------------------------------------------- bookkeeping

    def _address_error(self, address: Address) -> str | None:
        if not is_allowed(self.producers, *address):
            return (f"{format_address(*address)} is not in kv_connector_extra_config."
                    "producers")
        return None

    def _queue_for(self, address: Address) -> queue.SimpleQueue | None:
        """(under the lock) The address' queue, its thread started on first use."""
        work = self._queues.get(address)
        if work is None and len(self._queues) < MAX_PRODUCERS:
            work = self._queues[address] = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(address, work), daemon=True,
                             name=f"aserve-kv-pull-{format_address(*address)}").start()
        return work

    def _fail(self, load: _Load, reason: str) -> None:
        with self._lock:
            if load.state in (_State.DONE, _State.FAILED):
                return
            load.state = _State.FAILED
            self._loads.pop(load.pull.req_id, None)
            self._failed.add(load.pull.req_id)
        pull = load.pull
        logger.warning("KV pull of %s from %s failed (%s); it is recomputed", pull.req_id,
                       format_address(pull.host, pull.port), reason)

    def _commit(self, load: _Load) -> bool:
        """The pull may write its blocks: its deadline has not passed, nor will it count."""
        with self._lock:
            if load.state != _State.PENDING or load.deadline < time.monotonic():
                return False
            load.state = _State.COMMITTED
            self._loads.pop(load.pull.req_id, None)
            return True

    def _done(self, load: _Load, num_bytes: int) -> None:
        with self._lock:
            load.state = _State.DONE
            self._recving.add(load.pull.req_id)
            self._num_bytes += num_bytes
            self._seconds += time.perf_counter() - load.start

    def _drop_peer(self, address: Address) -> None:
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            peer.close()

    # ---------------------------------------------------------------- one address' thread

    def _work(self, address: Address, work: queue.SimpleQueue) -> None:
        while (load := work.get()) is not None:
            if load.state != _State.PENDING:  # its deadline passed while it queued
                continue
            try:
                peer, tensors = self._receive(address, load)
                if not self._commit(load):
                    raise TimeoutError("the pull's deadline passed")
                num_bytes = self._write(load, tensors)
            except Exception as e:  # noqa: BLE001 - the request is recomputed
                self._drop_peer(address)
                self._fail(load, f"{type(e).__name__}: {e}")
                continue
            self._done(load, num_bytes)
            try:
                write_line(peer.stream, {"ack": True})
            except OSError:  # the blocks are here: the producer frees its own anyway
                self._drop_peer(address)

    def _budget(self, load: _Load, key: str) -> float:
        """Seconds the next step may take: its own timeout, within the pull's deadline."""
        remaining = load.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the pull's deadline passed")
        return min(self.timeouts[key], remaining)

    def _ask(self, address: Address, load: _Load) -> tuple[Peer, dict]:
        """The producer's answer to this pull, over the kept connection or a new one."""
        request = {"handle": load.pull.handle,
                   "block_ids": [list(ids) for ids in load.pull.remote_ids]}
        with self._lock:
            peer = self._peers.get(address)
        if peer is not None:
            try:
                return peer, peer.request(request, self._budget(load, "transfer_timeout_s"))
            except (OSError, ConnectionError):  # the producer closed it since (a restart)
                self._drop_peer(address)
        peer = self._connect(address, load)
        with self._lock:
            self._peers[address] = peer
        return peer, peer.request(request, self._budget(load, "transfer_timeout_s"))

    def _connect(self, address: Address, load: _Load) -> Peer:
        """A new connection to the producer. Forming the two-rank gloo group fails now and
        then under load ("connectFullMesh failed ... Connection closed by peer", seen about
        once in 20 test runs beside another CPU-bound process): that is tried once more,
        within the pull's deadline; a refusal (ValueError) or a timeout is not."""
        host, port = address

        def connect() -> Peer:
            return Peer.connect(host, port + self.tp_rank, self.kv_cache_key, self.tp_rank,
                                self.secret, self._budget(load, "connect_timeout_s"),
                                self.timeouts["transfer_timeout_s"])

        try:
            return connect()
        except RuntimeError as e:  # torch.distributed's errors
            logger.info("Forming the KV group with %s:%s failed (%s); once more", host, port, e)
        return connect()

    def _receive(self, address: Address, load: _Load) -> tuple[Peer, list]:
        """The pull's blocks, per group (None: none asked), in host memory."""
        peer, reply = self._ask(address, load)
        if not reply.get("ok"):
            raise ValueError(f"the producer refused: {str(reply.get('error'))[:200]}")
        dtype = self._check_reply(reply, load.pull)
        tensors = []  # checked: exactly the blocks asked, in this cache's layout
        for group, shape in enumerate(reply["shapes"]):
            tensor = torch.empty(shape, dtype=dtype) if shape is not None else None
            if tensor is not None:
                peer.group.recv([tensor], 0, group).wait(
                    seconds(self._budget(load, "transfer_timeout_s")))
            tensors.append(tensor)
        return peer, tensors

    def _write(self, load: _Load, tensors: list) -> int:
        for group, (tensor, local) in enumerate(zip(tensors, load.pull.local_ids)):
            if tensor is not None:
                self.paged.write(group, local, tensor)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _check_reply(self, reply: dict, pull: Pull) -> torch.dtype:
        """This cache's dtype, if the reply's dtype and shapes are exactly what this pull's
        blocks are here (a ValueError otherwise)."""
        dtype = self.paged.group_buffers[0][0].dtype
        if reply.get("dtype") != str(dtype):
            raise ValueError(f"the producer sends dtype {str(reply.get('dtype'))[:40]!r}, this "
                             f"cache holds {dtype}")
        expected = [self._shape(group, len(ids)) if ids else None
                    for group, ids in enumerate(pull.local_ids)]
        if reply.get("shapes") != expected:
            raise ValueError(f"the producer sends shapes {str(reply.get('shapes'))[:200]}, "
                             f"this pull's blocks are {expected}")
        return dtype

    def _shape(self, group: int, num_blocks: int) -> list[int]:
        """What `paged.read(group, ids)` gives for `num_blocks` ids."""
        shape = list(self.paged.block_shape(group))
        shape[2] = num_blocks
        return shape
