"""kv_transfer_params and --kv-transfer-config at the server's edge: params on an instance
without a connector are a 400 that never reaches the engine; a bad connector configuration is a
clear startup error (exit 1). The producer → consumer path over HTTP, through the proxy, is
tests/server/test_disagg_serving.py."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from helpers.server import assert_error, serving, tiny_app

MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. "
             "Hello! How are you today?"}]


def test_kv_transfer_params_without_a_connector_are_a_400(llama_dir):
    with serving(tiny_app(llama_dir)) as url:
        for route, payload in (("completions", {"prompt": "hi"}),
                               ("chat/completions", {"messages": MESSAGES})):
            response = httpx.post(f"{url}/v1/{route}", timeout=30, json={
                "model": "tiny", **payload, "kv_transfer_params": {"do_remote_decode": True}})
            assert_error(response, 400, "kv_transfer_params", "needs a KV connector")
        streamed = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "hi", "stream": True,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert_error(streamed, 400, contains="needs stream=false")
        ok = httpx.post(f"{url}/v1/completions", timeout=30,
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["kv_transfer_params"] is None


@pytest.mark.parametrize("config, message", [
    ('{"kv_connector": "NixlConnector"}', "not a connector aserve has"),
    ('{"kv_connector": "P2pConnector", "kv_role": "prefill"}', "kv_role must be one of"),
    ('{"kv_connector": ', "not valid JSON"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}', "shared_storage_path"),
    ('{"kv_connector": "P2pConnector", "kv_porrt": 1}', "unknown keys ['kv_porrt']"),
])
def test_bad_kv_transfer_config_is_a_clear_startup_error(llama_dir, config, message):
    result = subprocess.run([sys.executable, "-m", "aserve", "--model", str(llama_dir),
                             "--kv-transfer-config", config], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and message in result.stderr, result.stderr
