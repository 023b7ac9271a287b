"""The disaggregated-prefill proxy (`aserve/disagg_proxy.py`) against fake instances: what each
side is sent, round-robin, and every way an instance can fail (unreachable, an error of its
own, a broken answer, dying mid-stream, silence). The proxy in front of real aserve instances is
tested in tests/server/test_disagg_serving.py. Its guards (body size, API key, connection
limits) are tested at the end."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import tracemalloc

import httpx
import pytest
from helpers.server import assert_error, free_port, serving
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from aserve.disagg_proxy import ProxyConfig, build_proxy_app, parse_args, prefill_body


def fake_instance(name: str, log: list, *, params=True, status=200, die_midway=False,
                  stall: float = 0.0):
    """An instance that records each request body; as a prefill it returns kv_transfer_params
    naming itself, as a decode it answers with text naming itself and the params it got."""

    async def generate(request: Request):
        body = json.loads(await request.body())
        log.append((name, request.url.path, body, dict(request.headers)))
        if stall:
            await asyncio.sleep(stall)
        if status != 200:
            return JSONResponse({"error": {"message": f"{name} refuses", "type": "BadRequestError",
                                           "param": "temperature", "code": status}}, status)
        text = f"{name}:{json.dumps(body.get('kv_transfer_params'), sort_keys=True)}"
        if not body.get("stream"):
            out = {"id": "x", "object": "text_completion", "choices": [{"text": text}]}
            if params:
                out["kv_transfer_params"] = {"remote_handle": name, "do_remote_prefill": True}
            return JSONResponse(out)

        async def events():
            for piece in (text[:5], text[5:]):
                yield f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n"
                await asyncio.sleep(0.01)
                if die_midway:
                    raise RuntimeError("the instance died")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request):
        return JSONResponse({}, 200)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/health", health), Route("/v1/models", models)])


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def proxy(prefill, decode, **kwargs):
    return serving(build_proxy_app(ProxyConfig(prefill, decode, **kwargs)))


def stream_text(response) -> tuple[str, list]:
    events = [json.loads(line[6:]) for line in response.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events if "choices" in e)
    return text, [e for e in events if "error" in e]


def test_prefill_then_decode_with_the_prefill_params():
    log = []
    with serving(fake_instance("P", log)) as p, serving(fake_instance("D", log)) as d, \
            proxy([p], [d]) as url:
        body = {"model": "m", "prompt": "hello", "max_tokens": 20, "min_tokens": 3, "n": 2,
                "stream_options": {"include_usage": True}, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body,
                       headers={"Authorization": "Bearer k", "X-Request-Id": "rid-1"})
        assert r.status_code == 200, r.text
        expected = json.dumps({"do_remote_prefill": True, "remote_handle": "P"}, sort_keys=True)
        assert r.json()["choices"][0]["text"] == f"D:{expected}"
        (pn, _, pb, ph), (dn, _, db, dh) = log
        assert (pn, dn) == ("P", "D")
        # the prefill: one token, one choice, not streamed, asked to keep the KV for a decode
        assert pb == {"model": "m", "prompt": "hello", "max_tokens": 1, "n": 1, "stream": False,
                      "temperature": 0, "kv_transfer_params": {
                          "do_remote_decode": True, "do_remote_prefill": False,
                          "remote_engine_id": None, "remote_block_ids": None,
                          "remote_host": None, "remote_port": None}}
        # the decode: the client's request as it was, plus the prefill's params
        assert db == {**body, "kv_transfer_params": {"remote_handle": "P",
                                                     "do_remote_prefill": True}}
        for headers in (ph, dh):
            assert headers["authorization"] == "Bearer k" and headers["x-request-id"] == "rid-1"


def test_chat_keeps_the_prompt_shaping_fields_and_max_completion_tokens():
    log = []
    with serving(fake_instance("P", log)) as p, serving(fake_instance("D", log)) as d, \
            proxy([p], [d]) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "max_completion_tokens": 9, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream")
            text, errors = stream_text(r)
        assert text.startswith("D:") and "remote_handle" in text and errors == []
        prefill = log[0][2]
        assert prefill["tools"] == body["tools"] and prefill["messages"] == body["messages"]
        assert prefill["max_completion_tokens"] == 1 and "max_tokens" not in prefill
        assert prefill["stream"] is False
        assert log[1][2]["max_completion_tokens"] == 9 and log[1][2]["stream"] is True


def test_round_robin_over_several_of_each():
    log = []
    with serving(fake_instance("P0", log)) as p0, serving(fake_instance("P1", log)) as p1, \
            serving(fake_instance("D0", log)) as d0, serving(fake_instance("D1", log)) as d1, \
            proxy([p0, p1], [d0, d1]) as url:
        for _ in range(4):
            assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    names = [name for name, *_ in log]
    assert sorted(names) == ["D0", "D0", "D1", "D1", "P0", "P0", "P1", "P1"]
    # a decode gets the params of the prefill that ran its request
    assert all(f'"remote_handle": "{log[i][0]}"' in json.dumps(log[i + 1][2])
               for i in range(0, 8, 2))


def test_an_unreachable_instance_is_skipped_and_none_reachable_is_503():
    log = []
    with serving(fake_instance("P", log)) as p, serving(fake_instance("D", log)) as d:
        with proxy([dead_url(), p], [d, dead_url()]) as url:
            for _ in range(3):
                r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
                assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("D:")
        with proxy([dead_url()], [d]) as url:
            r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
            assert_error(r, 503, contains="no prefill instance could be reached")
        with proxy([p], [dead_url()]) as url:
            assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}), 503,
                         contains="no decode instance")


def test_an_instance_error_reaches_the_client_as_it_is():
    log = []
    with serving(fake_instance("P", log, status=400)) as p, \
            serving(fake_instance("D", log)) as d, proxy([p], [d]) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": -1})
        assert_error(r, 400, param="temperature", contains="P refuses")
        assert [name for name, *_ in log] == ["P"]  # never sent on to a decode
    log = []
    with serving(fake_instance("P", log)) as p, serving(fake_instance("D", log, status=422)) as d, \
            proxy([p], [d]) as url:
        for stream in (False, True):
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": stream})
            assert_error(r, 422, contains="D refuses")


def test_a_prefill_without_a_connector_is_502():
    with serving(fake_instance("P", [], params=False)) as p, serving(fake_instance("D", [])) as d, \
            proxy([p], [d]) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
        assert_error(r, 502, contains="returned no kv_transfer_params")


def test_a_decode_dying_midway_ends_the_stream_with_an_error():
    with serving(fake_instance("P", [])) as p, \
            serving(fake_instance("D", [], die_midway=True)) as d, proxy([p], [d]) as url:
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": "x", "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            text, errors = stream_text(r)
        assert text == 'D:{"d' and len(errors) == 1  # the first piece, then the error
        error = errors[0]["error"]
        assert error["code"] == 502 and "while streaming" in error["message"]


def test_a_silent_instance_is_504_not_a_hang():
    with serving(fake_instance("P", [], stall=3.0)) as p, serving(fake_instance("D", [])) as d, \
            proxy([p], [d], timeout=0.5) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert_error(r, 504, contains="did not answer in time")


def test_bad_client_requests_are_400():
    with serving(fake_instance("P", [])) as p, serving(fake_instance("D", [])) as d, \
            proxy([p], [d]) as url:
        assert_error(httpx.post(url + "/v1/completions", content=b"{nope"), 400,
                     contains="not valid JSON")
        assert_error(httpx.post(url + "/v1/completions", json=[1]), 400, contains="JSON object")
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})
        assert_error(r, 400, param="kv_transfer_params", contains="set by the proxy")


def test_models_and_health():
    with serving(fake_instance("P", [])) as p, serving(fake_instance("D", [])) as d:
        with proxy([p], [d]) as url:
            assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "D"
            assert httpx.get(url + "/health").status_code == 200
        dead = dead_url()
        with proxy([p, dead], [d]) as url:
            r = httpx.get(url + "/health")
            assert r.status_code == 503
            assert r.json()["instances"] == {dead: {"role": "prefill", "status": "ConnectError"}}


def test_prefill_body_leaves_the_client_request_alone():
    body = {"prompt": "x", "max_tokens": 5, "stream": True, "stream_options": {}}
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert body == {"prompt": "x", "max_tokens": 5, "stream": True, "stream_options": {}}


@pytest.mark.parametrize("argv, message", [
    (["--prefill", "http://a"], "--decode"),
    (["--prefill", "a:1", "--decode", "http://b"], "start with http://"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_takes_several_of_each():
    args = parse_args(["--prefill", "http://a", "--prefill", "http://b", "--decode", "http://c",
                       "--port", "9"])
    assert (args.prefill, args.decode, args.port) == (["http://a", "http://b"], ["http://c"], 9)


# ---- guarding the proxy: body size, API key, connections ------------------------------------

def counted_chunks(total: int, counter: list[int], size: int = 1 << 16):
    """A chunked body of `total` bytes (no Content-Length); `counter[0]` is how much of it the
    proxy has pulled so far."""
    chunk = b"x" * size
    for _ in range(total // size):
        counter[0] += size
        yield chunk


def test_a_body_over_the_limit_is_413_before_anything_is_forwarded():
    log = []
    with serving(fake_instance("P", log)) as p, serving(fake_instance("D", log)) as d, \
            proxy([p], [d], max_request_body_bytes=1 << 20) as url:
        padded = {"prompt": "x", "pad": "y" * (1 << 20)}  # Content-Length says it
        r = httpx.post(url + "/v1/completions", json=padded, timeout=30)
        assert_error(r, 413, contains="larger than 1048576 bytes")
        assert r.headers["connection"] == "close"
        pulled = [0]  # chunked: counted as it comes
        tracemalloc.start()
        try:
            r = httpx.post(url + "/v1/chat/completions", timeout=30,
                           content=counted_chunks(50 << 20, pulled))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert_error(r, 413, contains="larger than 1048576 bytes")
        assert pulled[0] < 25 << 20  # it stopped reading: the rest was never sent
        assert peak < 16 << 20  # nor held: 50 MB read whole would be 50 MB at least
        assert log == []
        small = {"prompt": "x", "pad": "y" * ((1 << 20) - 100)}
        assert httpx.post(url + "/v1/completions", json=small, timeout=30).status_code == 200
        assert [name for name, *_ in log] == ["P", "D"]


def test_with_a_key_v1_needs_it_and_it_is_passed_on():
    log = []
    with serving(fake_instance("P", log)) as p, serving(fake_instance("D", log)) as d, \
            proxy([p], [d], api_key="sesame") as url:
        body = {"prompt": "x"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = httpx.post(url + "/v1/completions", json=body, headers=headers)
            assert_error(r, 401, contains="API key")
            assert_error(httpx.get(url + "/v1/models", headers=headers), 401)
        assert log == []
        # refused before its body is read, however large it says it is
        r = httpx.post(url + "/v1/completions", content=counted_chunks(8 << 20, [0]))
        assert_error(r, 401)
        assert httpx.get(url + "/health").status_code == 200  # open, as the server's
        key = {"Authorization": "Bearer sesame"}
        assert httpx.post(url + "/v1/completions", json=body, headers=key).status_code == 200
        assert httpx.get(url + "/v1/models", headers=key).status_code == 200
        assert [h["authorization"] for _, _, _, h in log] == ["Bearer sesame"] * 2


def test_cli_key_body_limit_and_connection_limits_reach_uvicorn(monkeypatch):
    from aserve import disagg_proxy

    ran = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: ran.update(app=app, **kwargs))
    monkeypatch.setattr(disagg_proxy, "raise_fd_limit", lambda n: ran.update(fds=n))
    monkeypatch.setenv("ASERVE_API_KEY", "from-env")
    disagg_proxy.main(["--prefill", "http://a", "--decode", "http://b", "--port", "9",
                       "--max-request-body-bytes", "1000", "--timeout-header-read", "3",
                       "--timeout-keep-alive", "2", "--max-connections", "7"])
    config = ran["app"].state.proxy.config
    assert (config.api_key, config.max_request_body_bytes) == ("from-env", 1000)
    limits = ran["http"].limits
    assert (limits.timeout_header_read, limits.max_connections) == (3.0, 7)
    assert ran["timeout_keep_alive"] == 2.0 and ran["fds"] == 7
    args = parse_args(["--prefill", "http://a", "--decode", "http://b"])
    assert (args.max_request_body_bytes, args.api_key, args.max_connections) == (16 << 20, None,
                                                                                 2048)


@pytest.mark.spawns
def test_the_proxy_process_closes_slow_heads_and_caps_connections():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve.disagg_proxy", "--prefill", dead_url(), "--decode",
         dead_url(), "--port", str(port), "--api-key", "k", "--timeout-header-read", "1",
         "--max-connections", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert_error(httpx.get(url + "/v1/models"), 401)  # served, by the app
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        for sock in slow:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        deadline = time.monotonic() + 5  # once the proxy has accepted all four
        while (r := httpx.get(url + "/v1/models")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert_error(r, 503, contains="too many open connections")
        for sock in slow:  # closed by the header deadline, so the cap frees up
            sock.settimeout(5)
            assert sock.recv(100) == b""
            sock.close()
        time.sleep(0.2)
        assert_error(httpx.get(url + "/v1/models"), 401)
    finally:
        proc.kill()
        proc.wait()
