"""Servers for the tests: `serving` (uvicorn in a thread around an app), `tiny_app` (aserve's app
on a tiny model), `free_port` and `wait_healthy` (for `python -m aserve` run as a subprocess), and
`assert_error` (an error response in OpenAI's shape)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 60) -> None:
    """Poll `url`/health until it answers 200; fail if `proc` exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stderr = proc.stderr.read()[-2000:] if proc.stderr else ""
            raise AssertionError(f"the server exited before it was healthy: {stderr}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server was not healthy within the deadline")


@contextlib.contextmanager
def serving(app, timeout: float = 60.0) -> Iterator[str]:
    """Run `app` under uvicorn in a thread on 127.0.0.1; yield its base URL; stop it afterwards."""
    import uvicorn

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


def tiny_app(model_dir, config=None, **engine_kwargs):
    """aserve's app (`build_app`) on `model_dir` in float32, max_model_len 256 unless overridden;
    `config` is a `ServerConfig` (served_model_name "tiny" by default)."""
    from aserve.engine.arg_utils import EngineArgs
    from aserve.server import ServerConfig, build_app

    kwargs = {"dtype": "float32", "max_model_len": 256, **engine_kwargs}
    return build_app(EngineArgs(model=str(model_dir), **kwargs),
                     config or ServerConfig(served_model_name="tiny"))


def assert_error(response, status: int, param=..., contains: str = "") -> None:
    """`response` (an httpx.Response) is `status` with OpenAI's error body: only "error", holding
    message/type/param/code, code == status, a type like "BadRequestError", `contains` in the
    message and, unless `param` is left out, that param (None included)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["type"], str) and error["type"].endswith("Error"), error
    assert contains in error["message"], error
    if param is not ...:
        assert error["param"] == param, error
