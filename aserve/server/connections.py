"""Connection limits for the uvicorn that runs `python -m aserve` or the disaggregation proxy: a
deadline for each request head, an idle keep-alive timeout and a cap on open connections.

uvicorn (h11 or httptools) arms no timer until a first response is done, and even then the
first byte of the next request disarms its keep-alive timer: a client that opens connections
and trickles (or never sends) its request heads keeps them open forever. Its
`limit_concurrency` counts those connections too, but only answers 503 to a *complete* request
head, so it locks out everyone else instead. `guarded_protocol` subclasses uvicorn's protocol
so that every connection has a timer, and is closed when it runs out:

    a connection is ...                   its timer
    accepted, its request head unfinished timeout_header_read, from the accept
    running a request (head complete)     none: the body and the response take what they take
    idle after a response                 timeout_keep_alive (uvicorn's own)
    sending its next head (a byte came)   timeout_header_read, from that byte

and a connection beyond `max_connections` is answered 503 (+ Retry-After) as it is accepted,
before anything is parsed, then closed. These are uvicorn settings: an app mounted in another
server (`build_app`) gets that server's limits, not these.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from aserve.server.errors import ErrorResponse

logger = logging.getLogger("aserve.connections")

PROTOCOLS = {"h11": "uvicorn.protocols.http.h11_impl:H11Protocol",
             "httptools": "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol"}
RETRY_AFTER_S = 1
LINGER_S = 1.0  # how long a refused connection may take to read its 503 before it is closed
FD_RESERVE = 512  # file descriptors kept for everything but client connections
WARN_EVERY_S = 10.0  # refusals are logged once per this many seconds, not once per connection


@dataclass(frozen=True)
class ConnectionLimits:
    timeout_header_read: float = 10.0  # seconds to deliver a whole request head
    timeout_keep_alive: float = 5.0  # seconds an idle kept-alive connection stays open
    # Enough for --max-num-seqs 256 + --max-waiting-requests 512 streams, each holding a
    # connection, and as many idle kept-alive ones.
    max_connections: int = 2048

    def uvicorn_options(self, http: str = "auto") -> dict[str, Any]:
        """Keyword arguments of `uvicorn.Config` (or `uvicorn.run`) that enforce these limits."""
        return {"http": guarded_protocol(self, http), "timeout_keep_alive": self.timeout_keep_alive}


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def add_connection_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    defaults = ConnectionLimits()
    parser.add_argument("--timeout-header-read", type=_positive(float), metavar="SECONDS",
                        default=defaults.timeout_header_read,
                        help="close a connection that has not sent a whole request head this "
                             "long after it opened, or after the first byte of its next "
                             f"request (default: {defaults.timeout_header_read:g})")
    parser.add_argument("--timeout-keep-alive", type=_positive(float), metavar="SECONDS",
                        default=defaults.timeout_keep_alive,
                        help="close a kept-alive connection idle this long after a response "
                             f"(default: {defaults.timeout_keep_alive:g})")
    parser.add_argument("--max-connections", type=_positive(int), metavar="N",
                        default=defaults.max_connections,
                        help="open client connections at most; one more is answered 503 and "
                             f"closed at once (default: {defaults.max_connections})")


def connection_limits_from(ns: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(timeout_header_read=ns.timeout_header_read,
                            timeout_keep_alive=ns.timeout_keep_alive,
                            max_connections=ns.max_connections)


def raise_fd_limit(max_connections: int) -> None:
    """Raise the soft limit on open files so that the connection cap, not EMFILE, is what
    refuses clients (then the process could open no file or socket of its own either): room
    for `max_connections` served, as many refused ones lingering, and FD_RESERVE more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * max_connections + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):  # macOS caps it below the hard limit (OPEN_MAX)
        new = soft
    if new < wanted:
        logger.warning("open files are limited to %d (ulimit -Hn), fewer than the %d that "
                       "--max-connections %d needs; raise the hard limit or lower "
                       "--max-connections", new, wanted, max_connections)


def is_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def guarded_protocol(limits: ConnectionLimits, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (`http`: auto, h11 or httptools, as uvicorn picks it)
    with `limits` enforced, for `uvicorn.Config(http=...)`."""
    from uvicorn.importer import import_from_string

    if http == "auto":  # uvicorn's own choice
        http = "httptools" if is_installed("httptools") else "h11"
    if http not in PROTOCOLS:
        raise ValueError(f"connection limits support http={sorted(PROTOCOLS)} or auto, "
                         f"not {http!r}")
    base = import_from_string(PROTOCOLS[http])
    refusal = _refusal(limits.max_connections)
    return type(f"Guarded{base.__name__}", (_GuardedProtocol, base),
                {"limits": limits, "refusal": refusal, "last_warning": 0.0, "num_lingering": 0})


def _refusal(max_connections: int) -> bytes:
    body = ErrorResponse.of(f"The server has too many open connections ({max_connections}). "
                            "Retry later.", 503).model_dump_json().encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class _GuardedProtocol:
    """Put before uvicorn's H11Protocol or HttpToolsProtocol (`guarded_protocol`); relies on
    what both have: `connections` (the server's open ones), `cycle` (the latest request, set
    once its head is complete), `transport`, `loop`."""

    limits: ConnectionLimits
    refusal: bytes
    last_warning: float
    num_lingering: int  # refused connections of this server not closed yet
    header_timer: asyncio.TimerHandle | None = None
    refused = False
    lingers = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # the request of a refused connection: read and dropped
        if self.header_timer is None and self._is_awaiting_head():
            self._arm_header_timer()  # the first byte of the next request on a kept-alive one
        super().data_received(data)
        if self.header_timer is not None and not self._is_awaiting_head():
            self.header_timer.cancel()
            self.header_timer = None

    def eof_received(self) -> bool | None:
        if self.refused:
            return None  # the client has read its 503: close
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        if self.lingers:
            type(self).num_lingering -= 1
            self.lingers = False
        if not self.refused:
            super().connection_lost(exc)

    def _is_awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self.header_timer = self.loop.call_later(self.limits.timeout_header_read,
                                                 self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self.header_timer = None
        if not self._is_awaiting_head() or self.transport.get_protocol() is not self:
            return  # a request started, or the connection was handed over (an upgrade)
        if not self.transport.is_closing():
            logger.debug("closing a connection from %s: no whole request head within %g s",
                         self.client, self.limits.timeout_header_read)
            self.transport.close()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 before reading anything. The request may be in flight already: half-close
        and drop what comes until the client closes (at most LINGER_S), so that it reads the
        503 rather than a reset. At most `max_connections` linger; more are just closed."""
        self.refused = True
        cls = type(self)
        now = time.monotonic()
        if now - cls.last_warning > WARN_EVERY_S:
            cls.last_warning = now
            logger.warning("refusing connections: %d open (--max-connections)",
                           self.limits.max_connections)
        transport.write(self.refusal)
        if cls.num_lingering >= self.limits.max_connections or not transport.can_write_eof():
            transport.close()
            return
        cls.num_lingering += 1
        self.lingers = True
        transport.write_eof()
        self.loop.call_later(LINGER_S, transport.abort)
