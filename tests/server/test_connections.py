"""Connection limits (`aserve/server/connections.py`) under a real uvicorn on 127.0.0.1, for both
of uvicorn's HTTP/1.1 protocols: slowloris connections (a request head trickled or never sent)
are closed after --timeout-header-read while others are served, and connections beyond
--max-connections are answered 503 at once, until the others go."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aserve.server import connections
from aserve.server.connections import (
    ConnectionLimits,
    add_connection_args,
    connection_limits_from,
    guarded_protocol,
)

PROTOCOLS = ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    not connections.is_installed("httptools"), reason="httptools is not installed"))]


async def echo(request: Request) -> PlainTextResponse:
    body = await request.body()
    await asyncio.sleep(float(request.query_params.get("sleep", 0)))
    return PlainTextResponse(f"{request.method} {len(body)}")


APP = Starlette(routes=[Route("/", echo, methods=["GET", "POST"])])


@contextlib.contextmanager
def serving(http: str, **limits) -> Iterator[tuple[str, int]]:
    """uvicorn in a thread with `ConnectionLimits(**limits)`; yields (host, port)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    options = ConnectionLimits(**limits).uvicorn_options(http)
    server = uvicorn.Server(uvicorn.Config(APP, log_level="error", lifespan="off", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def connect(address, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    if data:
        sock.sendall(data)
    return sock


def is_closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (what it sent before is read
    and dropped)."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionError:
            return True
    return False


def get(address, path: str = "/") -> httpx.Response:
    return httpx.get(f"http://{address[0]}:{address[1]}{path}", timeout=10)


def wait_for_status(address, status: int, within: float = 5) -> httpx.Response:
    """GET until the answer is `status` (the server accepts and drops connections in its own
    time)."""
    deadline = time.monotonic() + within
    while (response := get(address)).status_code != status and time.monotonic() < deadline:
        time.sleep(0.05)
    return response


PARTIAL_HEAD = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("http", PROTOCOLS)
def test_slowloris_connections_are_closed_while_others_are_served(http):
    with serving(http, timeout_header_read=1.0, timeout_keep_alive=30) as address:
        silent = [connect(address) for _ in range(10)]
        trickling = [connect(address, PARTIAL_HEAD) for _ in range(10)]
        for _ in range(3):  # a byte every 0.3 s: a keep-alive-style timer would never fire
            time.sleep(0.3)
            for sock in trickling:
                with contextlib.suppress(OSError):  # closed already, on a slow machine
                    sock.sendall(b"X")
        assert get(address).text == "GET 0"  # the canary, while they hang
        deadline = time.monotonic() + 5
        for sock in silent + trickling:
            assert is_closed_by_server(sock, deadline - time.monotonic())
            sock.close()
        assert get(address).text == "GET 0"


@pytest.mark.parametrize("http", PROTOCOLS)
def test_the_header_deadline_applies_again_to_the_next_request_of_a_kept_alive_connection(http):
    with serving(http, timeout_header_read=1.0, timeout_keep_alive=30) as address:
        sock = connect(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\n")  # the next head, never finished
        for _ in range(3):
            time.sleep(0.3)
            with contextlib.suppress(OSError):
                sock.sendall(b"X-A: b\r\n")
        assert is_closed_by_server(sock, 5)


@pytest.mark.parametrize("http", PROTOCOLS)
def test_a_head_in_time_is_served_even_when_body_and_response_take_longer(http):
    """The deadline is the head's only: a slow head within it, then a body and a response that
    come after it has passed, are served."""
    with serving(http, timeout_header_read=1.0) as address:
        sock = connect(address)
        for piece in (b"POST /?sleep=1.5 HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Length: 2\r\n",
                      b"\r\n"):
            sock.sendall(piece)
            time.sleep(0.2)
        time.sleep(1.0)
        sock.sendall(b"{}")
        response = b""
        while b"POST 2" not in response:
            chunk = sock.recv(65536)
            assert chunk, f"closed before the response: {response!r}"
            response += chunk
        assert response.startswith(b"HTTP/1.1 200")
        sock.close()


@pytest.mark.parametrize("http", PROTOCOLS)
def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(http):
    with serving(http, timeout_header_read=30, timeout_keep_alive=0.5) as address:
        sock = connect(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert is_closed_by_server(sock, 5)


@pytest.mark.parametrize("http", PROTOCOLS)
def test_connections_beyond_the_cap_get_503_until_others_close(http):
    with serving(http, max_connections=5, timeout_header_read=30) as address:
        held = [connect(address) for _ in range(5)]
        assert wait_for_status(address, 503).status_code == 503
        for _ in range(3):
            refused = get(address)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == 503
            assert "too many open connections (5)" in refused.json()["error"]["message"]
        extra = connect(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert is_closed_by_server(extra, 5)  # answered and closed, not kept waiting
        held.pop().close()
        assert wait_for_status(address, 200).text == "GET 0"
        for sock in held:
            sock.close()
        assert wait_for_status(address, 200).status_code == 200
        with httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=10) as client:
            assert [client.get("/").status_code for _ in range(5)] == [200] * 5


def test_auto_picks_what_uvicorn_would():
    expected = "HttpToolsProtocol" if connections.is_installed("httptools") else "H11Protocol"
    assert guarded_protocol(ConnectionLimits()).__name__ == f"Guarded{expected}"
    with pytest.raises(ValueError, match="connection limits support"):
        guarded_protocol(ConnectionLimits(), "zttp")


def test_flags_and_their_defaults():
    import argparse

    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    assert connection_limits_from(parser.parse_args([])) == ConnectionLimits(
        timeout_header_read=10.0, timeout_keep_alive=5.0, max_connections=2048)
    ns = parser.parse_args(["--timeout-header-read", "2.5", "--timeout-keep-alive", "1",
                            "--max-connections", "64"])
    assert connection_limits_from(ns) == ConnectionLimits(2.5, 1.0, 64)
    options = connection_limits_from(ns).uvicorn_options("h11")
    assert options["timeout_keep_alive"] == 1.0 and options["http"].limits.max_connections == 64
    for bad in (["--max-connections", "0"], ["--timeout-header-read", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_the_open_files_limit_is_raised_to_fit_the_cap(monkeypatch):
    calls = []
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(connections.resource, "setrlimit", lambda _, limits: calls.append(limits))
    connections.raise_fd_limit(1000)
    assert calls == [(2 * 1000 + connections.FD_RESERVE, 4096)]
    connections.raise_fd_limit(10_000)  # only as far as the hard limit
    assert calls[-1] == (4096, 4096)
    calls.clear()
    connections.raise_fd_limit(200)  # 1024 is enough
    assert calls == []


def test_python_m_aserve_serves_with_the_limits_of_its_flags(monkeypatch):
    from aserve.server import cli, launch

    served = {}

    async def fake_serve(app, server, sock, banner, log_filter, shutdown_timeout):
        served["config"] = server.config

    monkeypatch.setattr(launch, "serve_until_stopped", fake_serve)
    monkeypatch.setattr(cli, "raise_fd_limit", lambda n: served.update(fds=n))
    ns = cli.build_parser().parse_args(["--port", "0", "--timeout-header-read", "4",
                                        "--timeout-keep-alive", "3", "--max-connections", "99"])
    assert cli.serve(cli.engine_args_from(ns), ns) == 0
    config = served["config"]
    assert config.http.limits == ConnectionLimits(4.0, 3.0, 99)
    assert config.timeout_keep_alive == 3.0 and served["fds"] == 99
    defaults = cli.build_parser().parse_args([])
    assert connection_limits_from(defaults) == ConnectionLimits()
