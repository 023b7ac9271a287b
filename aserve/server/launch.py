"""Running the app under uvicorn for `python -m aserve`: the socket bound before the model
loads, signal handling while it loads and while it serves, a grace period on shutdown after which
in-flight requests are aborted (finish_reason "abort"), and a non-zero exit when the engine dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette

ABORT_MARGIN_S = 5  # after aborting what is left, the seconds uvicorn waits for responses


class StartupLogFilter(logging.Filter):
    """While the engine starts, a failure is reported by `main` in one line: drop the engine's
    own traceback of it (shown at --uvicorn-log-level debug)."""

    def __init__(self, show_tracebacks: bool) -> None:
        super().__init__()
        self.starting = not show_tracebacks

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.starting and record.exc_info)


def configure_logging(level: str) -> StartupLogFilter:
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(name)s: %(message)s"))
    log_filter = StartupLogFilter(show_tracebacks=level in ("debug", "trace"))
    handler.addFilter(log_filter)
    logger = logging.getLogger("aserve")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())
    logger.propagate = False
    return log_filter


def bind(host: str, port: int) -> socket.socket:
    """Bind before the model loads, so that a busy port fails in a second, not after loading;
    `serve_until_stopped` listens once the engine is ready (until then connections are refused).

    The socket is made with proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on accepted sockets whose proto says TCP, and the accepted ones take the
    listener's. With Nagle on, a response's second write (its body, after its headers) waited
    for the client's delayed ACK, so every reply with a body on a kept-alive connection came
    late by that timer (docs/benchmarks/serving-latency.md, "Nagle on the server's sockets").
    TCP_NODELAY is also set on the listener, which Linux passes on to accepted sockets."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


@contextlib.contextmanager
def signal_handlers(handler: Callable[[int, Any], None], *signals: int) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (uvicorn then sets none either)
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # SIGTERM while the model loads (even as a container's PID 1)


def ignore_signal(signum: int, frame: Any) -> None:
    pass


async def serve_until_stopped(app: Starlette, server: uvicorn.Server, sock: socket.socket,
                              banner: str, log_filter: StartupLogFilter,
                              shutdown_timeout: float) -> None:
    """Serve until a signal (graceful: in-flight requests get `shutdown_timeout` seconds, then
    are aborted with finish_reason "abort") or until the engine dies (EngineDeadError: the
    process exits non-zero, so that a supervisor restarts it)."""
    from aserve.engine.async_engine import EngineDeadError
    from aserve.server.app import aserve_lifespan

    async with aserve_lifespan(app):  # loads the model; raises if the engine cannot start
        engine = app.state.aserve.engine
        log_filter.starting = False
        sock.listen(server.config.backlog)  # accept (queue) connections only from now
        print(banner, file=sys.stderr, flush=True)
        watchers = [asyncio.create_task(abort_after_grace(server, engine, shutdown_timeout)),
                    asyncio.create_task(stop_when_dead(server, engine))]
        try:
            # uvicorn handles SIGINT/SIGTERM while it serves (a graceful shutdown), then
            # re-raises the signal to the handler it found: make that one a no-op, so that the
            # engine stops after the server and the process exits 0.
            with signal_handlers(ignore_signal, signal.SIGINT, signal.SIGTERM):
                await server.serve(sockets=[sock])
        finally:
            for task in watchers:
                task.cancel()
        if engine.dead_error is not None:
            raise EngineDeadError(engine.dead_error)


async def abort_after_grace(server: uvicorn.Server, engine, shutdown_timeout: float) -> None:
    while not server.should_exit:
        await asyncio.sleep(0.05)
    await asyncio.sleep(shutdown_timeout)
    if engine.num_requests_in_flight:
        logging.getLogger("aserve").warning(
            "Shutting down: aborting %d requests still running after %g s",
            engine.num_requests_in_flight, shutdown_timeout)
        engine.abort_all()


async def stop_when_dead(server: uvicorn.Server, engine) -> None:
    await engine.dead.wait()
    logging.getLogger("aserve").error("The engine died (%s); shutting down", engine.dead_error)
    await asyncio.sleep(0.5)  # let in-flight requests write their errors
    server.should_exit = True
