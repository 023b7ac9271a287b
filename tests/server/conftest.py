"""A real uvicorn server on 127.0.0.1 (a free port) around `build_app`, for the server tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from aserve.engine.arg_utils import EngineArgs
from aserve.server import ServerConfig, build_app


@contextlib.contextmanager
def serving(app, timeout: float = 60.0) -> Iterator[str]:
    """Run `app` under uvicorn in a thread; yield its base URL; stop it afterwards."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def tiny_app(model_dir, config: ServerConfig | None = None, **engine_kwargs):
    kwargs = {"dtype": "float32", "max_model_len": 256, **engine_kwargs}
    return build_app(EngineArgs(model=str(model_dir), **kwargs),
                     config or ServerConfig(served_model_name="tiny"))


@pytest.fixture(scope="module")
def server_url(model_dir_factory) -> Iterator[str]:
    with serving(tiny_app(model_dir_factory("llama"))) as url:
        yield url
