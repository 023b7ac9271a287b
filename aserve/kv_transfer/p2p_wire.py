"""The P2P connector's control channel: JSON lines over TCP, each at most `MAX_LINE_BYTES`, and a
consumer rank's connection to one producer rank (`Peer`).

    producer rank (listening)                     consumer rank (`Peer.connect`)
    {"nonce"}                       ────────────►
                                    ◄────────────  {"kv_cache_key", "rank", "proof"}
    {"ok", "store_port"} (or ok false, closed) ──►
    TCPStore + ProcessGroupGloo rank 0  ═════════  ProcessGroupGloo rank 1
    then per pull: {"handle", "block_ids"} ◄── ; ──► {"ok", "shapes", "dtype"}; blocks over
    gloo; ◄── {"ack"}

Every read from a peer is bounded: a line's length, and the time it may take.
"""

from __future__ import annotations

import datetime
import json
import socket
from typing import Any

import torch.distributed as dist

from aserve.kv_transfer.p2p_auth import hello_proof

MAX_LINE_BYTES = 1 << 20


def write_line(stream, message: dict) -> None:
    """One JSON line. Both ends' sockets have Nagle's algorithm off (TCP_NODELAY): a consumer
    writes its ack and then its next pull back to back, and with Nagle on every pull would
    wait for the producer's delayed ACK of the ack (docs/benchmarks/serving-latency.md, "Nagle
    on the server's sockets")."""
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def read_line(stream, allow_eof: bool = False) -> dict | None:
    """One JSON object of at most `MAX_LINE_BYTES`; a ValueError for a longer line or anything
    but an object, a ConnectionError for a closed connection (None with `allow_eof`)."""
    line = stream.readline(MAX_LINE_BYTES + 1)
    if not line:
        if allow_eof:
            return None
        raise ConnectionError("the peer closed the connection")
    if len(line) > MAX_LINE_BYTES or not line.endswith(b"\n"):
        raise ValueError(f"the peer sent a line over {MAX_LINE_BYTES} bytes (or cut one off)")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("the peer sent a JSON line that is not an object")
    return message


def close_socket(sock: socket.socket) -> None:
    """Shut down first: a bare close leaves a thread blocked in accept() or recv()."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(value, 0.001))


class Peer:
    """A consumer rank's connection to one producer rank: the socket and their gloo group."""

    def __init__(self, sock: socket.socket, stream, store, group) -> None:
        self.sock, self.stream, self.store, self.group = sock, stream, store, group

    @classmethod
    def connect(cls, host: str, port: int, kv_cache_key: str, rank: int, secret: bytes,
                connect_timeout_s: float, transfer_timeout_s: float) -> Peer:
        """Consumer rank `rank` (of KV cache key `kv_cache_key`) joins the producer rank
        listening on host:port: it answers the producer's nonce with its proof of the secret,
        then they build their two-rank gloo group. Each step waits at most its timeout."""
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see write_line
        stream = sock.makefile("rwb")
        try:
            nonce = read_line(stream).get("nonce")
            if not isinstance(nonce, str):
                raise ValueError("the producer sent no nonce")
            write_line(stream, {"kv_cache_key": kv_cache_key, "rank": rank,
                                "proof": hello_proof(secret, nonce, kv_cache_key, rank)})
            reply = read_line(stream)
            if not reply.get("ok") or not isinstance(reply.get("store_port"), int):
                raise ValueError(f"the producer refused: {reply.get('error')}")
            store = dist.TCPStore(host, reply["store_port"], 2, False,
                                  timeout=seconds(connect_timeout_s))
            group = dist.ProcessGroupGloo(dist.PrefixStore("kv", store), 1, 2,
                                          seconds(transfer_timeout_s))
        except BaseException:
            close_socket(sock)
            raise
        sock.settimeout(transfer_timeout_s)
        return cls(sock, stream, store, group)

    def request(self, message: dict[str, Any], timeout_s: float) -> dict:
        """Send one line and read the answer, within `timeout_s`."""
        self.sock.settimeout(timeout_s)
        write_line(self.stream, message)
        return read_line(self.stream)

    def close(self) -> None:
        close_socket(self.sock)
