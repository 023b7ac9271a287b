"""kv_transfer_params and --kv-transfer-config at the server's edge: params on an instance
without a connector are a 400 that never reaches the engine, and so are params a P2P consumer
would pull with that no producer signed, or that name a producer outside its allow-list (and
nothing connects to the address they name); a bad connector configuration (a P2P one without a
secret included) is a clear startup error (exit 1). The producer → consumer path over HTTP,
through the proxy, is tests/server/test_disagg_serving.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers.disagg import KV_SECRET
from helpers.server import assert_error, free_port, serving, tiny_app

from aserve.kv_transfer.p2p_auth import sign_params

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


def test_p2p_params_no_producer_signed_or_outside_the_allow_list_are_a_400(llama_dir,
                                                                         monkeypatch):
    monkeypatch.setenv("ASERVE_KV_SECRET", KV_SECRET)
    listener = socket.create_server(("127.0.0.1", 0))  # where a client would aim the consumer
    listener.settimeout(0.5)
    aimed = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
             "remote_port": listener.getsockname()[1], "remote_handle": "h",
             "remote_block_ids": [[1]], "remote_num_tokens": 2, "remote_prompt_hash": "0",
             "remote_kv_cache_key": "k", "tp_size": 1}
    config = {"kv_connector": "P2pConnector", "kv_role": "kv_consumer", "kv_port": free_port(),
              "kv_connector_extra_config": {"producers": [f"127.0.0.1:{free_port()}"]}}
    cases = [(aimed, "are not signed"),
             ({**aimed, "remote_signature": sign_params(aimed, b"a-guess-0123456789")},
              "are not signed"),
             ({**aimed, "remote_signature": sign_params(aimed, KV_SECRET.encode())},
              "not in this instance's kv_connector_extra_config.producers")]
    try:
        with serving(tiny_app(llama_dir, kv_transfer_config=config)) as url:
            for params, message in cases:
                for route, payload in (("completions", {"prompt": "hi"}),
                                       ("chat/completions", {"messages": MESSAGES})):
                    response = httpx.post(f"{url}/v1/{route}", timeout=30, json={
                        "model": "tiny", **payload, "kv_transfer_params": params})
                    assert_error(response, 400, "kv_transfer_params", message)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody came
    finally:
        listener.close()


@pytest.mark.parametrize("config, message", [
    ('{"kv_connector": "P2pConnector", "kv_role": "kv_consumer"}', "ASERVE_KV_SECRET"),
    ('{"kv_connector": "NixlConnector"}', "not a connector aserve has"),
    ('{"kv_connector": "P2pConnector", "kv_role": "prefill"}', "kv_role must be one of"),
    ('{"kv_connector": ', "not valid JSON"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}', "shared_storage_path"),
    ('{"kv_connector": "P2pConnector", "kv_porrt": 1}', "unknown keys ['kv_porrt']"),
])
def test_bad_kv_transfer_config_is_a_clear_startup_error(llama_dir, config, message):
    env = {k: v for k, v in os.environ.items() if k != "ASERVE_KV_SECRET"}
    result = subprocess.run([sys.executable, "-m", "aserve", "--model", str(llama_dir),
                             "--kv-transfer-config", config], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 1 and message in result.stderr, result.stderr


def test_a_producer_holds_at_most_its_share_for_pulls_then_503s(llama_dir):
    """Remote decodes nobody pulls: past max_held_share of the cache the producer answers 503
    + Retry-After (before, 40 such requests held 14 % of the cache for the 2-minute lease, and
    ~280 all of it); everyone else is still served, and once the leases end it admits again."""
    num_blocks, share, lease = 64, 0.25, 2.0  # at most 16 blocks held: two 6-block prompts
    config = {"kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_port": free_port(),
              "kv_connector_extra_config": {"secret": KV_SECRET, "max_held_share": share,
                                            "lease_timeout_s": lease}}
    prompts = [[5 + i] * 90 for i in range(4)]  # 90 tokens: 6 blocks of 16 each

    def remote_decode(prompt):
        return httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})

    with serving(tiny_app(llama_dir, kv_transfer_config=config, num_kv_blocks=num_blocks)) as url:
        held = [remote_decode(p) for p in prompts[:2]]
        assert [r.status_code for r in held] == [200, 200], [r.text for r in held]
        assert all(r.json()["kv_transfer_params"]["remote_handle"] for r in held)
        refused = remote_decode(prompts[2])
        assert_error(refused, 503, contains="max_held_share")
        assert refused.headers["Retry-After"] == "1"
        victim = httpx.post(f"{url}/v1/completions", timeout=30,
                            json={"model": "tiny", "prompt": prompts[3], "max_tokens": 3})
        assert victim.status_code == 200  # (no kv_transfer_params: no cap)
        deadline = time.monotonic() + 30
        while (again := remote_decode(prompts[2])).status_code == 503:
            assert time.monotonic() < deadline, "the leases ended, the blocks still count"
            time.sleep(0.5)
        assert again.status_code == 200, again.text
