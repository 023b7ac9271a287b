"""A proxy for disaggregated prefill: each request is prefilled on one instance and decoded on
another, whose KV connector loads the prompt's KV instead of recomputing it (docs/design.md,
"Disaggregated prefill").

    python -m aserve.disagg_proxy --prefill http://h1:8100 --decode http://h2:8200 --port 8000

For `/v1/completions` and `/v1/chat/completions` the proxy

1. sends the request to a prefill instance (a `kv_producer`) as a one-token, non-streamed
   request carrying `kv_transfer_params: {"do_remote_decode": true, ...}`;
2. copies the `kv_transfer_params` of its response into the original request and sends that to
   a decode instance (a `kv_consumer`);
3. returns the decode side's response unchanged: status, headers that matter and, streamed or
   not, its body byte for byte.

Instances are taken round-robin per role (xPyD). One that cannot be reached is skipped for the
next of its role; when none answers the client gets a 503, a broken or silent one a 502 / 504,
all in OpenAI's error shape, never a hang. An instance's own 4xx / 5xx reaches the client as it
is. `/v1/models` is answered by a decode instance and `/health` is 200 only when every instance
is healthy.

Guarding it (SECURITY.md): with `--api-key` (or $ASERVE_API_KEY) every `/v1/*` route needs
`Authorization: Bearer <key>` (401 otherwise, checked before the body is read); the header is
passed on to the instances, which may check the same key. A body over
`--max-request-body-bytes` (16 MiB, the server's default) is refused with 413 as its bytes
arrive, before anything is forwarded, so a request holds one bounded body. Connections get the
server's limits (`server/connections.py`: a deadline for the request head, a cap on open
connections).
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import itertools
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aserve.server.connections import add_connection_args, connection_limits_from, raise_fd_limit
from aserve.server.errors import ErrorResponse, error_response

logger = logging.getLogger("aserve.disagg_proxy")

# What the prefill side is asked for: vLLM's shape, so either engine's connector understands it.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields of the client's request that a one-token, one-choice, non-streamed prefill cannot take.
# Everything that shapes the prompt (messages, tools, the chat template's arguments) stays, or
# the prefilled KV would be another prompt's.
_PREFILL_DROPS = ("stream_options", "min_tokens", "best_of")
# Headers passed to the instances as they came; hop-by-hop ones and the body's are not.
_FORWARDED_HEADERS = ("authorization", "x-request-id", "user-agent")
_RETURNED_HEADERS = ("content-type", "x-request-id")
API_KEY_ENV = "ASERVE_API_KEY"
GUARDED_PREFIX = "/v1"
# Refusals of a request whose body may still be coming close the connection after them, so that
# uvicorn does not go on receiving the rest only to throw it away.
_CLOSE = {"Connection": "close"}


class ProxyError(Exception):
    def __init__(self, message: str, status: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    timeout: float = 600.0  # seconds an instance may take to answer (or between stream chunks)
    connect_timeout: float = 5.0
    max_request_body_bytes: int = 16 << 20  # the server's default (`ServerConfig`)
    api_key: str | None = None  # `/v1/*` needs `Authorization: Bearer <key>` when set


class Pool:
    """The instances of one role, taken round-robin; `order()` starts at the next one and then
    offers the others, for a request whose instance could not be reached."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"at least one --{role} URL is required")
        self.role = role
        self.urls = [url.rstrip("/") for url in urls]
        self._next = itertools.cycle(range(len(self.urls)))

    def order(self) -> list[str]:
        start = next(self._next)
        return self.urls[start:] + self.urls[:start]


def prefill_body(body: dict) -> dict:
    """The request a prefill instance gets: one token, not streamed, one choice, asking to hold
    the prompt's KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(stream=False, n=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "max_completion_tokens" in out:  # chat's newer name; the client chose it, keep it alone
        out["max_completion_tokens"] = 1
        out.pop("max_tokens", None)
    else:
        out["max_tokens"] = 1
    return out


class DisaggProxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = Pool("prefill", config.prefill)
        self.decode = Pool("decode", config.decode)
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.timeout, connect=self.config.connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # ---- talking to instances ------------------------------------------------------------

    async def _send(self, pool: Pool, path: str, body: dict, headers: dict[str, str],
                    stream: bool) -> tuple[str, httpx.Response]:
        """POST `body` to the first instance of `pool` that can be reached; the response is
        open (not read) when `stream`."""
        assert self.client is not None
        unreachable = []
        for url in pool.order():
            request = self.client.build_request("POST", url + path, json=body, headers=headers)
            try:
                return url, await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                logger.warning("%s instance %s unreachable: %s", pool.role, url, exc)
                unreachable.append(url)
            except httpx.TimeoutException as exc:
                raise ProxyError(f"{pool.role} instance {url} did not answer in time", 504) from exc
            except httpx.TransportError as exc:
                raise ProxyError(f"{pool.role} instance {url} failed: {exc!r}", 502) from exc
        raise ProxyError(f"no {pool.role} instance could be reached ({', '.join(unreachable)})",
                         503)

    async def _prefill(self, path: str, body: dict, headers: dict[str, str]) -> dict | Response:
        """The prefill instance's `kv_transfer_params`, or its error response as it came."""
        url, response = await self._send(self.prefill, path, prefill_body(body), headers, False)
        if response.status_code != 200:
            return _relay(response, response.content)
        try:
            params = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError) as exc:
            raise ProxyError(f"prefill instance {url} answered with a body that is not JSON",
                             502) from exc
        if not isinstance(params, dict):
            raise ProxyError(f"prefill instance {url} returned no kv_transfer_params: is it "
                             "started with --kv-transfer-config and kv_role kv_producer or "
                             "kv_both?", 502)
        return params

    # ---- routes ----------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        try:
            body = json.loads(await read_body(request, self.config.max_request_body_bytes))
        except ProxyError as exc:
            return error_response(str(exc), exc.status, headers=exc.headers)
        except ValueError:
            return error_response("the request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        if "kv_transfer_params" in body:
            return error_response("kv_transfer_params is set by the proxy; a client may not send "
                                  "it", 400, "kv_transfer_params")
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        headers.setdefault("x-request-id", f"disagg-{uuid.uuid4().hex}")
        path = request.url.path
        try:
            params = await self._prefill(path, body, headers)
            if isinstance(params, Response):
                return params
            body = {**body, "kv_transfer_params": params}
            stream = bool(body.get("stream"))
            url, response = await self._send(self.decode, path, body, headers, stream)
        except ProxyError as exc:
            return error_response(str(exc), exc.status)
        if not stream or response.status_code != 200:
            content = await response.aread() if stream else response.content
            await response.aclose()
            return _relay(response, content)
        return StreamingResponse(_relay_stream(url, response), status_code=200,
                                 headers=_returned_headers(response),
                                 background=BackgroundTask(response.aclose))

    async def models(self, request: Request) -> Response:
        assert self.client is not None
        for url in self.decode.order():
            try:
                response = await self.client.get(url + "/v1/models", headers=_auth(request))
            except httpx.TransportError:
                continue
            return _relay(response, response.content)
        return error_response("no decode instance could be reached", 503)

    async def health(self, request: Request) -> Response:
        assert self.client is not None
        failing = {}
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            for url in pool.urls:
                try:
                    status = (await self.client.get(url + "/health", timeout=5.0)).status_code
                except httpx.TransportError as exc:
                    status = type(exc).__name__
                if status != 200:
                    failing[url] = {"role": role, "status": status}
        if failing:
            return JSONResponse({"status": "unhealthy", "instances": failing}, status_code=503)
        return JSONResponse({"status": "ok"})


async def read_body(request: Request, limit: int) -> bytearray:
    """The request's body, refused past `limit` bytes (413): by its Content-Length before a
    byte is read, else as the bytes arrive (a chunked body too)."""
    too_large = ProxyError(f"The request body is larger than {limit} bytes.", 413, _CLOSE)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        raise ProxyError("The client disconnected before sending its body.", 499) from None
    return body


class ProxyKeyMiddleware:
    """`/v1/*` needs `Authorization: Bearer <key>`, compared in constant time: the server's check
    (`server/auth.py`, which the proxy cannot import: through the server's frontend it loads
    the engine and torch)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PREFIX):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response("Invalid or missing API key.", 401, headers=_CLOSE)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"authorization": value} if value else {}


def _returned_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k in _RETURNED_HEADERS}


def _relay(response: httpx.Response, content: bytes) -> Response:
    return Response(content, status_code=response.status_code,
                    headers=_returned_headers(response))


async def _relay_stream(url: str, response: httpx.Response) -> AsyncIterator[bytes]:
    """The decode instance's event stream as it comes. If the instance fails midway the client
    gets one last event with an error in OpenAI's shape, then the end of the stream."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("decode instance %s failed while streaming: %r", url, exc)
        status = 504 if isinstance(exc, httpx.TimeoutException) else 502
        error = ErrorResponse.of(f"decode instance {url} failed while streaming: {exc!r}", status)
        yield f"data: {error.model_dump_json()}\n\n".encode()


def build_proxy_app(config: ProxyConfig) -> Starlette:
    proxy = DisaggProxy(config)
    routes = [
        Route("/v1/completions", proxy.generate, methods=["POST"]),
        Route("/v1/chat/completions", proxy.generate, methods=["POST"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    middleware = [Middleware(ProxyKeyMiddleware, api_key=config.api_key)] if config.api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.proxy = proxy
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m aserve.disagg_proxy",
        description="Route each request through a prefill instance (kv_producer) and a decode "
                    "instance (kv_consumer), round-robin over several of each.")
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill instance's base URL (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode instance's base URL (repeat for several)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an instance may take to answer, or between stream chunks")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require `Authorization: Bearer KEY` on /v1 routes, passed on to "
                             f"the instances (default: ${API_KEY_ENV} if set, else no key)")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 << 20, metavar="N",
                        help="refuse (413) a request body larger than this, before forwarding "
                             "it (default: 16777216, 16 MiB)")
    add_connection_args(parser)
    args = parser.parse_args(argv)
    if args.max_request_body_bytes <= 0:
        parser.error("--max-request-body-bytes must be > 0")
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            parser.error(f"instance URLs start with http:// or https://, got {url!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = ProxyConfig(args.prefill, args.decode, timeout=args.timeout,
                         max_request_body_bytes=args.max_request_body_bytes,
                         api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    limits = connection_limits_from(args)
    raise_fd_limit(limits.max_connections)
    uvicorn.run(build_proxy_app(config), host=args.host, port=args.port, log_level="warning",
                **limits.uvicorn_options())


if __name__ == "__main__":
    main()
