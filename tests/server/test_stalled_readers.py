"""A streaming client that stops reading: once the connection's buffers are full and a write
has waited `stream_stall_timeout`, its request is aborted, its slots and KV blocks come back
and another user is served. (Before, such streams held every running slot until they had
generated all their tokens.)"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers.server import serving, tiny_app

from aserve.server import ServerConfig

pytestmark = pytest.mark.spawns  # a uvicorn server on a port


@pytest.fixture(scope="module")
def url(model_dir_factory) -> Iterator[str]:
    model = model_dir_factory("llama", max_position_embeddings=32768)
    config = ServerConfig(served_model_name="tiny", stream_stall_timeout=1.0)
    with serving(tiny_app(model, config, max_model_len=32768, max_num_seqs=16,
                          warmup=False)) as base:
        yield base


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"aserve:{name}"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def stream_and_never_read(url: str) -> socket.socket:
    """A streamed request of 16 choices x 30,000 tokens (minutes of work, every running slot)
    from a client with a 4 KB receive buffer that reads nothing: the server's socket and
    transport buffers (~2 MB on loopback) fill within a second or two of its start."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({"prompt": "Hello", "max_tokens": 30000, "n": 16, "stream": True,
                       "ignore_eos": True, "logprobs": 20}).encode()  # ~1 KB an event
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_a_stream_nobody_reads_is_aborted_and_frees_its_slots(url):
    sock = stream_and_never_read(url)
    try:
        deadline = time.monotonic() + 120  # (generous: seconds here, unloaded)
        while metric(url, "num_requests_running") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # (until it runs)
        while metric(url, "num_requests_running") > 0:
            assert time.monotonic() < deadline, "the stalled stream still holds its slots"
            time.sleep(0.2)
        assert metric(url, "kv_cache_usage_perc") == 0
        victim = httpx.post(f"{url}/v1/completions", timeout=30,
                            json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert victim.status_code == 200 and victim.json()["usage"]["completion_tokens"] == 3
        # the server cut the stream off and closed the connection: draining it ends, short
        # of the 480,000 tokens' events and the [DONE] a finished stream ends with
        sock.settimeout(30)
        received = bytearray()
        while chunk := sock.recv(1 << 16):
            received += chunk
        assert b"data: [DONE]" not in received and b'"finish_reason":"length"' not in received
    finally:
        sock.close()


def test_a_reader_that_keeps_up_is_never_cut_off(url):
    """Streams that are read (however many tokens) finish whole."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 400, "n": 4, "stream": True,
                            "ignore_eos": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e[6:])["choices"]]
    assert finishes.count("length") == 4
