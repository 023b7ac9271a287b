"""A P2P producer rank's worker side (`Sender`): it listens on kv_ip:kv_port + rank, lets in
only consumers that prove they hold the shared secret, and sends the blocks of the handles its
scheduler registered, each held until it is sent, its consumer fails mid-way, or its lease
(`lease_timeout_s`) ends. One thread per consumer connection (at most `MAX_CONNECTIONS`)."""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

from aserve.kv_transfer.base import PagedKV
from aserve.kv_transfer.p2p_auth import has_valid_proof
from aserve.kv_transfer.p2p_wire import close_socket, read_line, seconds, write_line

logger = logging.getLogger(__name__)

WAIT_FOR_HANDLE_S = 10.0  # a pull may arrive before the producer's rank has the handle
MAX_CONNECTIONS = 256  # consumer ranks connected at once; more are closed at once


@dataclass(frozen=True)
class Send:
    """Blocks a producer holds for a consumer: per group, the prompt's block ids."""

    handle: str
    req_id: str
    block_ids: tuple[tuple[int, ...], ...]


class Sender:
    """See the module docstring. `timeouts`: the connector's (`lease_timeout_s`,
    `connect_timeout_s`, `transfer_timeout_s`)."""

    def __init__(self, paged: PagedKV, kv_cache_key: str, tp_rank: int, secret: bytes,
                 timeouts: dict[str, float]) -> None:
        self.paged, self.kv_cache_key, self.tp_rank = paged, kv_cache_key, tp_rank
        self.secret, self.timeouts = secret, timeouts
        self._lock = threading.Condition()
        self._held: dict[str, tuple[Send, float]] = {}  # handle → (send, lease deadline)
        self._busy: set[str] = set()  # handles being sent now
        self._sent: set[str] = set()  # req ids sent (or given up) since take_finished
        self._gone: deque[str] = deque(maxlen=4096)  # handles sent or given up: refused at once
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._host = ""
        self._num_bytes, self._seconds = 0, 0.0
        self._closed = False

    def listen(self, host: str, port: int) -> None:
        self._host = host
        try:
            self._listener = socket.create_server((host, port))
        except OSError as e:
            raise ValueError(f"P2pConnector cannot listen on {host}:{port} (kv_ip, kv_port + "
                             f"rank {self.tp_rank}): {e}.") from None
        threading.Thread(target=self._accept, name="aserve-kv-listen", daemon=True).start()

    def hold(self, sends: Iterable[Send]) -> None:
        deadline = time.monotonic() + self.timeouts["lease_timeout_s"]
        with self._lock:
            for send in sends:
                self._held[send.handle] = (send, deadline)
            self._lock.notify_all()

    def take_finished(self) -> set[str]:
        """Requests whose blocks were sent, or given up (their lease over), since last call."""
        now = time.monotonic()
        with self._lock:
            for handle, (send, deadline) in list(self._held.items()):
                if deadline < now and handle not in self._busy:
                    logger.warning("No consumer pulled the KV of %s within %g s: its blocks "
                                   "are freed", send.req_id, self.timeouts["lease_timeout_s"])
                    self._release(handle, send)
            sent, self._sent = self._sent, set()
        return sent

    def take_stats(self) -> tuple[int, float]:
        with self._lock:
            stats = (self._num_bytes, self._seconds)
            self._num_bytes, self._seconds = 0, 0.0
        return stats

    def sockets(self) -> list[socket.socket]:
        with self._lock:
            return list(self._sockets)

    def shutdown(self) -> None:
        self._closed = True
        if self._listener is not None:
            close_socket(self._listener)
        for sock in self.sockets():
            close_socket(sock)

    def _release(self, handle: str, send: Send) -> None:
        """(under the lock) The handle's blocks go back to the scheduler."""
        self._held.pop(handle, None)
        self._gone.append(handle)
        self._sent.add(send.req_id)

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refuse = self._closed or len(self._sockets) >= MAX_CONNECTIONS
                if not refuse:
                    self._sockets.add(sock)
            if refuse:
                close_socket(sock)
                continue
            threading.Thread(target=self._serve, args=(sock,), name="aserve-kv-send",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """One consumer rank: the hello, then pulls one at a time until it hangs up. Reads time
        out within the hello or a transfer (a stuck consumer cannot pin blocks), not between
        pulls (the connection stays open for the next)."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rwb")
        sock.settimeout(self.timeouts["connect_timeout_s"])
        try:
            group = self._hello(stream)
            while group is not None:
                sock.settimeout(None)
                request = read_line(stream, allow_eof=True)
                if request is None:
                    break
                sock.settimeout(self.timeouts["transfer_timeout_s"])
                self._send_one(stream, group, request)
        except Exception as e:  # noqa: BLE001 - a consumer failed or left: its blocks go
            logger.warning("KV send to a consumer failed: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                self._sockets.discard(sock)
            close_socket(sock)

    def _hello(self, stream) -> dist.ProcessGroupGloo | None:
        """The consumer proves it holds the secret and has this rank's layout; their group."""
        nonce = secrets.token_hex(16)
        write_line(stream, {"nonce": nonce})
        hello = read_line(stream)
        if not has_valid_proof(hello, self.secret, nonce):
            logger.warning("A KV consumer connected without proof of the shared secret: "
                           "refused")
            write_line(stream, {"ok": False, "error": "not authenticated"})
            return None
        if hello["kv_cache_key"] != self.kv_cache_key or hello["rank"] != self.tp_rank:
            write_line(stream, {"ok": False, "error": "another model, dtype, block size or "
                                "TP layout"})
            return None
        store = dist.TCPStore(self._host, 0, 2, True, wait_for_workers=False,
                              timeout=seconds(self.timeouts["connect_timeout_s"]))
        write_line(stream, {"ok": True, "store_port": store.port})
        return dist.ProcessGroupGloo(dist.PrefixStore("kv", store), 0, 2,
                                     seconds(self.timeouts["transfer_timeout_s"]))

    def _send_one(self, stream, group, request: dict) -> None:
        handle = request.get("handle")
        with self._lock:
            self._lock.wait_for(lambda: handle in self._held or handle in self._gone
                                or self._closed, WAIT_FOR_HANDLE_S)
            entry = self._held.get(handle) if isinstance(handle, str) else None
            if entry is not None:
                self._busy.add(handle)
        if entry is None:
            write_line(stream, {"ok": False, "error": f"unknown or expired handle {handle!r}"})
            return
        send = entry[0]
        try:
            wanted = _wanted(request.get("block_ids"), send)
            if wanted is None:
                write_line(stream, {"ok": False, "error": "blocks the handle does not hold"})
                return
            self._send_blocks(stream, group, wanted)
        finally:
            with self._lock:
                self._busy.discard(handle)
                self._release(handle, send)

    def _send_blocks(self, stream, group, wanted: list[tuple[int, ...]]) -> None:
        start = time.perf_counter()
        tensors = [self.paged.read(g, ids).cpu().contiguous() if ids else None
                   for g, ids in enumerate(wanted)]  # (gloo: through host memory)
        dtype = str(self.paged.group_buffers[0][0].dtype)
        write_line(stream, {"ok": True, "dtype": dtype, "shapes": [
            list(t.shape) if t is not None else None for t in tensors]})
        for tag, tensor in enumerate(tensors):
            if tensor is not None:
                group.send([tensor], 1, tag).wait()
        read_line(stream)  # the consumer's ack: the blocks are in its cache
        with self._lock:
            self._num_bytes += sum(t.numel() * t.element_size() for t in tensors
                                   if t is not None)
            self._seconds += time.perf_counter() - start


def _wanted(block_ids, send: Send) -> list[tuple[int, ...]] | None:
    """The consumer's request, per group, if the handle holds every block of it."""
    if not isinstance(block_ids, list) or len(block_ids) != len(send.block_ids):
        return None
    wanted = []
    for ids, have in zip(block_ids, send.block_ids):
        if not (isinstance(ids, list) and all(type(i) is int for i in ids)
                and set(ids) <= set(have) - {0}):
            return None
        wanted.append(tuple(ids))
    return wanted
