"""`P2pConnector`: a consumer pulls a finished prefill's KV blocks straight from its producer,
over a torch.distributed process group of their own (gloo; one per producer rank and consumer
rank pair, built on first use).

    producer (kv_producer / kv_both)                consumer (kv_consumer / kv_both)
    request {"do_remote_decode": true} finishes
      request_finished → delay_free, params: host,
      port, handle, block ids, prompt digest, key ──► request {"do_remote_prefill": true, ...}
      rank r registers the handle (lease starts)      blocks allocated, WAITING_FOR_REMOTE_KVS
      rank r listens on kv_ip:kv_port + r  ◄── TCP ── rank r's pull thread: hello (its key)
        TCPStore + ProcessGroupGloo(rank 0 of 2) ───  ProcessGroupGloo(rank 1 of 2)
        {"handle", "block_ids"} ◄────────────────────  the blocks it needs, per group
        send each group's blocks ───── gloo ────────► recv, copy into its own blocks, ack
      finished_sending: the blocks are freed          finished_recving: the request is queued

Each rank moves its own kv heads; the scheduler counts a transfer finished once every rank
has (`RankReports`). Nothing hangs: the producer frees a handle's blocks once sent, when its
consumer fails mid-way, or when nobody pulled within `lease_timeout_s`; a consumer that cannot
reach its producer (gone, or the handle unknown or expired) fails the load and computes the
prompt itself, as it does when the producer's key, TP size or prompt differ from its own.
`kv_connector_extra_config`: `lease_timeout_s` (120), `connect_timeout_s` (5),
`transfer_timeout_s` (30).
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aserve.config import KVTransferConfig
from aserve.core.outputs import SchedulerOutput
from aserve.core.request import Request, RequestStatus
from aserve.kv_transfer.base import PROXY_PARAMS, KVConnectorBase, prompt_digest

logger = logging.getLogger(__name__)

TIMEOUTS = {"lease_timeout_s": 120.0, "connect_timeout_s": 5.0, "transfer_timeout_s": 30.0}
WAIT_FOR_HANDLE_S = 10.0  # a pull may arrive before the producer's rank has the handle


@dataclass(frozen=True)
class Send:
    """Blocks a producer holds for a consumer: per group, the prompt's block ids."""

    handle: str
    req_id: str
    block_ids: tuple[tuple[int, ...], ...]


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


@dataclass(frozen=True)
class P2pMetadata:
    pulls: tuple[Pull, ...] = ()
    sends: tuple[Send, ...] = ()


class P2pConnector(KVConnectorBase):
    """See the module docstring."""

    params_keys = PROXY_PARAMS | {"remote_handle", "remote_num_tokens", "remote_prompt_hash",
                                  "remote_kv_cache_key", "tp_size"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.config.kv_connector_extra_config
        self.timeouts = {k: float(extra.get(k, v)) for k, v in TIMEOUTS.items()}
        self.engine_id = self.config.engine_id or uuid.uuid4().hex
        # scheduler side
        self._pulled: set[str] = set()  # loaded once: a preempted request recomputes
        self._pulls: list[Pull] = []
        self._sends: list[Send] = []
        # worker side: producer
        self._lock = threading.Condition()
        self._held: dict[str, tuple[Send, float]] = {}  # handle → (send, lease deadline)
        self._busy: set[str] = set()  # handles being sent now
        self._sent: set[str] = set()  # req ids sent (or given up) since get_finished
        self._gone: deque[str] = deque(maxlen=4096)  # handles sent or given up: refused at once
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        # worker side: consumer
        self._pull_queue: queue.SimpleQueue[Pull | None] = queue.SimpleQueue()
        self._pull_thread: threading.Thread | None = None
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._num_bytes, self._seconds = 0, 0.0
        self._closed = False

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(TIMEOUTS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config has keys {unknown} that P2pConnector "
                             f"does not know; known: {', '.join(TIMEOUTS)}.")
        for key, value in extra.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be a positive number "
                                 f"of seconds, got {value!r}.")

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if (not (self.config.is_consumer and params.get("do_remote_prefill"))
                or request.request_id in self._pulled):
            return 0, True
        return max(0, request.num_prompt_tokens - num_computed_tokens), True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = request.kv_transfer_params
        first = request.num_computed_tokens // self.block_size
        last = -(-request.num_prompt_tokens // self.block_size)
        error = self._check_remote(request, params)
        remote_ids, local_ids = [], []
        for group, local in enumerate(block_ids):
            remote = params["remote_block_ids"][group][first:last] if error is None else []
            pairs = [(r, lo) for r, lo in zip(remote, local[first:last]) if r != 0]
            remote_ids.append(tuple(r for r, _ in pairs))
            local_ids.append(tuple(lo for _, lo in pairs))
        self._pulls.append(Pull(request.request_id, str(params.get("remote_host")),
                                params.get("remote_port") or 0,
                                str(params.get("remote_handle")), tuple(remote_ids),
                                tuple(local_ids), error))
        self._pulled.add(request.request_id)

    def _check_remote(self, request: Request, params: dict) -> str | None:
        """Why the producer's blocks cannot serve this request (None: they can)."""
        checks = (
            (params.get("remote_kv_cache_key") == self.kv_cache_key,
             "the producer's model, dtype, block size or TP layout differ"),
            (params.get("tp_size") == self.tp_size, "the producer's TP size differs"),
            (params.get("remote_num_tokens") == request.num_prompt_tokens
             and params.get("remote_prompt_hash") == prompt_digest(request.prompt_token_ids),
             "the producer computed another prompt"),
            (isinstance(params.get("remote_host"), str)
             and isinstance(params.get("remote_port"), int)
             and isinstance(params.get("remote_handle"), str), "no producer address"),
        )
        for ok, reason in checks:
            if not ok:
                return reason
        ids = params.get("remote_block_ids")
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        if not (isinstance(ids, list) and len(ids) == len(self.kv_cache_groups)
                and all(isinstance(g, list) and len(g) == num_blocks for g in ids)):
            return "remote_block_ids do not cover the prompt in every KV cache group"
        for group, spec in enumerate(self.kv_cache_groups):
            # what the last prompt token's window reads must still be on the producer
            window = spec.sliding_window or request.num_prompt_tokens + 1
            first_read = max(0, request.num_prompt_tokens - window) // self.block_size
            if any(b == 0 for b in ids[group][first_read:]):
                return f"the producer no longer holds group {group}'s window"
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pMetadata:
        meta = P2pMetadata(tuple(self._pulls), tuple(self._sends))
        self._pulls, self._sends = [], []
        return meta

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._pulled.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if (not self.config.is_producer or not params.get("do_remote_decode")
                or request.status == RequestStatus.FINISHED_ABORTED
                or request.num_computed_tokens < request.num_prompt_tokens):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        ids = [list(g[:num_blocks]) for g in block_ids]
        handle = uuid.uuid4().hex
        self._sends.append(Send(handle, request.request_id, tuple(tuple(g) for g in ids)))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_block_ids": ids,
            "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port,
            "remote_handle": handle, "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_hash": prompt_digest(request.prompt_token_ids),
            "remote_kv_cache_key": self.kv_cache_key, "tp_size": self.tp_size}

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        if self.config.is_producer:
            port = self.config.kv_port + self.tp_rank
            try:
                self._listener = socket.create_server((self.config.kv_ip, port))
            except OSError as e:
                raise ValueError(f"P2pConnector cannot listen on {self.config.kv_ip}:{port} "
                                 f"(kv_ip, kv_port + rank {self.tp_rank}): {e}.") from None
            threading.Thread(target=self._accept, name="aserve-kv-listen", daemon=True).start()
        if self.config.is_consumer:
            self._pull_thread = threading.Thread(target=self._pull_loop, name="aserve-kv-pull",
                                                 daemon=True)
            self._pull_thread.start()

    def bind_connector_metadata(self, metadata: P2pMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if metadata is None:
            return
        deadline = time.monotonic() + self.timeouts["lease_timeout_s"]
        with self._lock:
            for send in metadata.sends:
                self._held[send.handle] = (send, deadline)
            self._lock.notify_all()

    def start_load_kv(self) -> None:
        for pull in self._metadata.pulls if self._metadata is not None else ():
            self._pull_queue.put(pull)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            for handle, (send, deadline) in list(self._held.items()):
                if deadline < now and handle not in self._busy:
                    logger.warning("No consumer pulled the KV of %s within %g s: its blocks "
                                   "are freed", send.req_id, self.timeouts["lease_timeout_s"])
                    del self._held[handle]
                    self._gone.append(handle)
                    self._sent.add(send.req_id)
            sent, self._sent = self._sent, set()
            recving, self._recving = self._recving, set()
        return sent, recving

    def get_failed_loads(self) -> set[str]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def take_transfer_stats(self) -> tuple[int, float]:
        with self._lock:
            stats = (self._num_bytes, self._seconds)
            self._num_bytes, self._seconds = 0, 0.0
        return stats

    def shutdown(self) -> None:
        self._closed = True
        if self._listener is not None:
            _close(self._listener)  # (shutdown first: a bare close leaves accept() blocked)
        with self._lock:
            for sock in list(self._sockets):
                _close(sock)
        self._pull_queue.put(None)
        for peer in self._peers.values():
            peer.close()

    # ---------------------------------------------------------------- producer: serving

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._closed:
                _close(sock)
                return
            with self._lock:
                self._sockets.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="aserve-kv-send",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """One consumer rank: a hello, then pulls one at a time until it hangs up. Reads time
        out within a hello or a transfer (a stuck consumer cannot pin blocks), not between
        pulls (the connection stays open for the next)."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rwb")
        sock.settimeout(self.timeouts["transfer_timeout_s"])
        try:
            hello = _read(stream)
            if hello.get("kv_cache_key") != self.kv_cache_key or hello.get("rank") != self.tp_rank:
                _write(stream, {"ok": False, "error": "another model, dtype, block size or "
                                "TP layout"})
                return
            store = dist.TCPStore(self.config.kv_ip, 0, 2, True, wait_for_workers=False,
                                  timeout=self._timeout("connect_timeout_s"))
            _write(stream, {"ok": True, "store_port": store.port})
            group = dist.ProcessGroupGloo(dist.PrefixStore("kv", store), 0, 2,
                                          self._timeout("transfer_timeout_s"))
            while True:
                sock.settimeout(None)
                request = _read(stream, allow_eof=True)
                if request is None:
                    break
                sock.settimeout(self.timeouts["transfer_timeout_s"])
                self._send_one(stream, group, request)
        except Exception as e:  # noqa: BLE001 - a consumer failed or left: its blocks go
            logger.warning("KV send to a consumer failed: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                self._sockets.discard(sock)
            _close(sock)

    def _send_one(self, stream, group, request: dict) -> None:
        handle = request.get("handle")
        with self._lock:
            self._lock.wait_for(lambda: handle in self._held or handle in self._gone
                                or self._closed, WAIT_FOR_HANDLE_S)
            entry = self._held.get(handle)
            if entry is not None:
                self._busy.add(handle)
        if entry is None:
            _write(stream, {"ok": False, "error": f"unknown or expired handle {handle!r}"})
            return
        send = entry[0]
        try:
            wanted = [tuple(ids) for ids in request.get("block_ids", ())]
            if len(wanted) != len(send.block_ids) or not all(
                    set(w) <= set(have) - {0} for w, have in zip(wanted, send.block_ids)):
                _write(stream, {"ok": False, "error": "blocks the handle does not hold"})
                return
            start = time.perf_counter()
            tensors = [self.paged.read(g, ids).cpu().contiguous() if ids else None
                       for g, ids in enumerate(wanted)]  # (gloo: through host memory)
            _write(stream, {"ok": True, "shapes": [list(t.shape) if t is not None else None
                                                   for t in tensors]})
            for tag, tensor in enumerate(tensors):
                if tensor is not None:
                    group.send([tensor], 1, tag).wait()
            _read(stream)  # the consumer's ack: the blocks are in its cache
            with self._lock:
                self._num_bytes += sum(t.numel() * t.element_size() for t in tensors if
                                       t is not None)
                self._seconds += time.perf_counter() - start
        finally:
            with self._lock:
                self._busy.discard(handle)
                self._held.pop(handle, None)
                self._gone.append(handle)
                self._sent.add(send.req_id)

    # ---------------------------------------------------------------- consumer: pulling

    def _pull_loop(self) -> None:
        while (pull := self._pull_queue.get()) is not None:
            start = time.perf_counter()
            try:
                if pull.error is not None:
                    raise ValueError(pull.error)
                num_bytes = self._pull_one(pull)
            except Exception as e:  # noqa: BLE001 - the request is recomputed
                logger.warning("KV pull of %s from %s:%s failed (%s: %s); it is recomputed",
                               pull.req_id, pull.host, pull.port, type(e).__name__, e)
                peer = self._peers.pop((pull.host, pull.port), None)
                if peer is not None:
                    peer.close()
                with self._lock:
                    self._failed.add(pull.req_id)
                continue
            with self._lock:
                self._recving.add(pull.req_id)
                self._num_bytes += num_bytes
                self._seconds += time.perf_counter() - start

    def _pull_one(self, pull: Pull) -> int:
        request = {"handle": pull.handle, "block_ids": [list(g) for g in pull.remote_ids]}
        peer = self._peers.get((pull.host, pull.port))
        try:  # a kept connection the producer has closed since (a restart): connect again
            if peer is None:
                raise ConnectionError("not connected")
            _write(peer.stream, request)
            reply = _read(peer.stream)
        except (OSError, ConnectionError):
            if peer is not None:
                peer.close()
            peer = _Peer.connect(pull.host, pull.port + self.tp_rank, self.kv_cache_key,
                                 self.tp_rank, self.timeouts["connect_timeout_s"],
                                 self.timeouts["transfer_timeout_s"])
            self._peers[(pull.host, pull.port)] = peer
            _write(peer.stream, request)
            reply = _read(peer.stream)
        if not reply.get("ok"):
            raise ValueError(f"the producer refused: {reply.get('error')}")
        dtype = self.paged.group_buffers[0][0].dtype
        num_bytes = 0
        for group, (shape, local) in enumerate(zip(reply["shapes"], pull.local_ids)):
            if shape is None:
                continue
            tensor = torch.empty(shape, dtype=dtype)
            peer.group.recv([tensor], 0, group).wait()
            self.paged.write(group, local, tensor)
            num_bytes += tensor.numel() * tensor.element_size()
        _write(peer.stream, {"ack": True})
        return num_bytes

    def _timeout(self, key: str) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeouts[key])


class _Peer:
    """A consumer rank's connection to one producer rank: the socket and their gloo group."""

    def __init__(self, sock: socket.socket, stream, store, group) -> None:
        self.sock, self.stream, self.store, self.group = sock, stream, store, group

    @classmethod
    def connect(cls, host: str, port: int, kv_cache_key: str, rank: int,
                connect_timeout_s: float, transfer_timeout_s: float) -> _Peer:
        """Consumer rank `rank` (of KV cache key `kv_cache_key`) joins the producer rank
        listening on host:port: a hello, then their two-rank gloo group."""
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see _write
        sock.settimeout(transfer_timeout_s)
        stream = sock.makefile("rwb")
        try:
            _write(stream, {"kv_cache_key": kv_cache_key, "rank": rank})
            reply = _read(stream)
            if not reply.get("ok"):
                raise ValueError(f"the producer refused: {reply.get('error')}")
            store = dist.TCPStore(host, reply["store_port"], 2, False,
                                  timeout=datetime.timedelta(seconds=connect_timeout_s))
            group = dist.ProcessGroupGloo(dist.PrefixStore("kv", store), 1, 2,
                                          datetime.timedelta(seconds=transfer_timeout_s))
        except BaseException:
            _close(sock)
            raise
        return cls(sock, stream, store, group)

    def close(self) -> None:
        _close(self.sock)


def _write(stream, message: dict) -> None:
    """One JSON line. Both ends' sockets have Nagle's algorithm off (TCP_NODELAY): a consumer
    writes its ack and then its next pull back to back, and with Nagle on the pull would wait
    for the producer's delayed ACK of the ack (40 ms a pull)."""
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def _read(stream, allow_eof: bool = False) -> dict | None:
    line = stream.readline()
    if not line:
        if allow_eof:
            return None
        raise ConnectionError("the peer closed the connection")
    return json.loads(line)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
