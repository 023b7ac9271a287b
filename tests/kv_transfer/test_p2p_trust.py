"""A P2P consumer trusts only its operator: params not signed with the shared secret, or naming a
producer outside the allow-list, are refused before anything connects (a ValueError offline, a
400 over HTTP: tests/server/test_disaggregated_http.py); a producer's reply that is not exactly
the consumer's layout fails the load before anything is allocated, and the prompt is
recomputed; a stalled producer delays only its own pulls, each at most `pull_timeout_s`; a
stranger without the secret is refused by the producer.

The worker sides here run without an engine, on small random caches, in this process; a
`Listener` stands at the address a client chose and records every connection it gets."""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.disagg import KV_SECRET
from helpers.hf_models import hf_greedy
from helpers.server import free_port

from aserve import LLM, SamplingParams
from aserve.config import KVCacheGroupSpec, KVTransferConfig
from aserve.kv_transfer import KVConnectorRole, create_connector
from aserve.kv_transfer.base import prompt_digest
from aserve.kv_transfer.p2p import P2pMetadata
from aserve.kv_transfer.p2p_auth import (
    has_valid_signature,
    hello_proof,
    resolve_secret,
    sign_params,
)
from aserve.kv_transfer.p2p_pull import Pull
from aserve.kv_transfer.p2p_send import Send
from aserve.kv_transfer.p2p_wire import Peer, read_line, write_line

BS, NUM_BLOCKS, HEADS, HEAD_DIM = 4, 8, 2, 8
KEY = "k" * 32
GROUPS = (KVCacheGroupSpec((0, 1), None, BS),)
NUM_NEW = 6


class Listener:
    """A socket listening at the address a client chose: `connections()` counts who came."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def connections(self, wait_s: float = 0.5) -> int:
        self.sock.settimeout(wait_s)
        count = 0
        try:
            while True:
                conn, _ = self.sock.accept()
                conn.close()
                count += 1
        except TimeoutError:
            return count

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener():
    stand = Listener()
    yield stand
    stand.close()


def p2p_config(role: str, port: int = 14579, **extra) -> KVTransferConfig:
    return KVTransferConfig.from_value({"kv_connector": "P2pConnector", "kv_role": role,
                                        "kv_port": port,
                                        "kv_connector_extra_config": {"secret": KV_SECRET,
                                                                      **extra}})


def worker(role: str, port: int = 14579, fill: bool = True, **extra):
    """A rank's worker side over a small random (or zero) KV cache of two layers."""
    connector = create_connector(p2p_config(role, port, **extra), KVConnectorRole.WORKER, KEY,
                                 GROUPS, BS)
    make = torch.randn if fill else torch.zeros
    connector.register_kv_caches({layer: make(2, NUM_BLOCKS, BS, HEADS, HEAD_DIM)
                                  for layer in (0, 1)})
    return connector


def wait_reports(connector, req_ids: set[str], timeout: float = 20) -> dict[str, tuple]:
    """req id → ("loaded" | "failed", seconds since the call), polling as the runner does."""
    start, reports = time.monotonic(), {}
    while set(reports) != req_ids:
        assert time.monotonic() - start < timeout, f"no report of {req_ids - set(reports)}"
        _, loaded = connector.get_finished(set())
        for kind, ids in (("loaded", loaded), ("failed", connector.get_failed_loads())):
            reports.update({r: (kind, time.monotonic() - start) for r in ids})
        time.sleep(0.02)
    return reports


def signed(params: dict, secret: str = KV_SECRET) -> dict:
    return {**params, "remote_signature": sign_params(params, secret.encode())}


# ---------------------------------------------------------------------------- the secret

def test_the_secret_comes_from_the_environment_first(monkeypatch):
    assert resolve_secret({"secret": KV_SECRET}) == KV_SECRET.encode()
    monkeypatch.setenv("ASERVE_KV_SECRET", "from-the-environment-0123")
    assert resolve_secret({"secret": KV_SECRET}) == b"from-the-environment-0123"
    assert resolve_secret({}) == b"from-the-environment-0123"
    monkeypatch.delenv("ASERVE_KV_SECRET")
    with pytest.raises(ValueError, match="ASERVE_KV_SECRET.*kv_connector_extra_config.secret"):
        resolve_secret({})
    with pytest.raises(ValueError, match="ASERVE_KV_SECRET"):
        create_connector(KVTransferConfig("P2pConnector"), KVConnectorRole.WORKER, KEY,
                         GROUPS, BS)


def test_a_signature_covers_every_key_and_survives_json():
    params = signed({"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 7,
                     "remote_block_ids": [[1, 2], [0, 3]], "remote_engine_id": None})
    assert has_valid_signature(json.loads(json.dumps(params)), KV_SECRET.encode())
    for key, value in (("remote_port", 8), ("remote_block_ids", [[1, 2], [3, 3]]),
                       ("remote_engine_id", "e"), ("tp_size", 1)):
        assert not has_valid_signature({**params, key: value}, KV_SECRET.encode()), key
    assert not has_valid_signature(params, b"another-secret-0123456789")
    del params["remote_signature"]
    assert not has_valid_signature(params, KV_SECRET.encode())


# ---------------------------------------------------------------------------- who is contacted

@pytest.fixture(scope="module")
def llama(model_dir_factory):
    model_dir = model_dir_factory("llama")
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(14)]
    return model_dir, prompt, hf_greedy(model_dir, [prompt], NUM_NEW)[0]


def consumer_llm(model_dir, **extra) -> LLM:
    config = {"kv_connector": "P2pConnector", "kv_role": "kv_consumer", "kv_port": free_port(),
              "kv_connector_extra_config": {"secret": KV_SECRET, **extra}}
    return LLM(str(model_dir), dtype="float32", block_size=BS, kv_transfer_config=config)


def params_for(llm: LLM, prompt: list[int], port: int) -> dict:
    """A producer's answer for `prompt`, naming 127.0.0.1:`port` (unsigned)."""
    num_blocks = -(-len(prompt) // BS)
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
            "remote_host": "127.0.0.1", "remote_port": port, "remote_handle": "h",
            "remote_block_ids": [list(range(1, num_blocks + 1))],
            "remote_num_tokens": len(prompt), "remote_prompt_hash": prompt_digest(prompt),
            "remote_kv_cache_key": llm.model_info.kv_cache_key, "tp_size": 1}


def generate(llm: LLM, prompt: list[int], params: dict) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, kv_transfer_params=params))
    return out[0].outputs[0].token_ids


def test_unsigned_forged_or_altered_params_are_refused_and_nothing_connects(llama, listener):
    model_dir, prompt, expected = llama
    with consumer_llm(model_dir) as consumer:
        genuine = signed(params_for(consumer, prompt, free_port()))
        aimed = params_for(consumer, prompt, listener.port)  # the client's address
        for bad in (aimed, signed(aimed, "not-the-operators-secret"),
                    {**genuine, "remote_port": listener.port},
                    {**aimed, "remote_signature": genuine["remote_signature"]}):
            with pytest.raises(ValueError, match="kv_transfer_params are not signed"):
                generate(consumer, prompt, bad)
        assert generate(consumer, prompt, {"do_remote_prefill": False}) == expected
        assert consumer.stats().num_kv_load_failures == 0  # none reached the engine
    assert listener.connections() == 0


def test_an_address_outside_the_allow_list_is_never_connected(llama, listener):
    model_dir, prompt, _ = llama
    allowed = f"127.0.0.1:{free_port()}"
    with consumer_llm(model_dir, producers=[allowed]) as consumer:
        params = signed(params_for(consumer, prompt, listener.port))  # a producer signed it
        with pytest.raises(ValueError, match="not in this instance's .*producers"):
            generate(consumer, prompt, params)
    assert listener.connections() == 0


def test_the_connector_itself_refuses_unsigned_params_and_unlisted_producers(listener):
    """Defence in depth, past the frontend: the scheduler side fails an unsigned pull at once,
    and a rank's puller connects to no address outside the allow-list."""
    from helpers.requests import make_request

    scheduler = create_connector(p2p_config("kv_consumer"), KVConnectorRole.SCHEDULER, KEY,
                                 GROUPS, BS)
    prompt = list(range(8))
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
              "remote_port": listener.port, "remote_handle": "h", "remote_block_ids": [[1, 2]],
              "remote_num_tokens": 8, "remote_prompt_hash": prompt_digest(prompt),
              "remote_kv_cache_key": KEY, "tp_size": 1}
    request = make_request("r", prompt, kv_transfer_params=params)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (8, True)
    scheduler.update_state_after_alloc(request, ([3, 4],), 8)
    (pull,) = scheduler.build_connector_meta(None).pulls
    assert "not signed" in pull.error
    consumer = worker("kv_consumer", fill=False, producers=[f"127.0.0.1:{free_port()}"])
    try:
        consumer.puller.submit(pull)
        consumer.puller.submit(Pull("s", "127.0.0.1", listener.port, "h", ((1, 2),), ((3, 4),)))
        reports = wait_reports(consumer, {"r", "s"}, timeout=5)
        assert all(kind == "failed" and seconds < 2 for kind, seconds in reports.values())
    finally:
        consumer.shutdown()
    assert listener.connections() == 0


# ---------------------------------------------------------------------------- what a peer says

class FakeProducer:
    """A producer rank that follows the protocol (nonce, proof, gloo group) but answers every
    pull with `reply`, and sends no block."""

    def __init__(self, reply: dict) -> None:
        self.reply, self.pulls = reply, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            stream = conn.makefile("rwb")
            try:
                write_line(stream, {"nonce": "n"})
                hello = read_line(stream)
                assert hello["proof"] == hello_proof(KV_SECRET.encode(), "n", hello[
                    "kv_cache_key"], hello["rank"])
                store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False,
                                      timeout=timedelta(seconds=5))
                write_line(stream, {"ok": True, "store_port": store.port})
                dist.ProcessGroupGloo(dist.PrefixStore("kv", store), 0, 2, timedelta(seconds=5))
                while read_line(stream, allow_eof=True) is not None:
                    self.pulls += 1
                    write_line(stream, self.reply)
            except (OSError, ValueError, ConnectionError):
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


# what a pull of 2 blocks is here: [layers 2, K and V, 2 blocks, BS, heads, head_dim]
RIGHT = [2, 2, 2, BS, HEADS, HEAD_DIM]


@pytest.mark.parametrize("reply, reason", [
    ({"shapes": [[2, 2, 1 << 40, BS, HEADS, HEAD_DIM]], "dtype": "torch.float32"}, "shapes"),
    ({"shapes": [[2, 2, 3, BS, HEADS, HEAD_DIM]], "dtype": "torch.float32"}, "shapes"),
    ({"shapes": [RIGHT, RIGHT], "dtype": "torch.float32"}, "shapes"),
    ({"shapes": [RIGHT], "dtype": "torch.float16"}, "dtype"),
    ({"shapes": [RIGHT]}, "dtype"),
])
def test_a_reply_not_in_this_cache_layout_fails_the_load_before_any_allocation(
        reply, reason, caplog, monkeypatch):
    fake = FakeProducer({"ok": True, **reply})
    consumer = worker("kv_consumer", fill=False, pull_timeout_s=20)
    empty = torch.empty
    allocated = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or empty(*a, **k))
    try:
        with caplog.at_level(logging.WARNING, "aserve.kv_transfer.p2p_pull"):
            consumer.puller.submit(Pull("r", "127.0.0.1", fake.port, "h", ((1, 2),), ((3, 4),)))
            (kind, seconds), = wait_reports(consumer, {"r"}).values()
        assert kind == "failed" and seconds < 10 and fake.pulls == 1
        assert f"sends {reason}" in caplog.text, caplog.text
        assert allocated == []  # nothing sized by the peer
        assert not consumer.paged.group_buffers[0][0].any()  # and nothing written
    finally:
        consumer.shutdown()
        fake.close()


def test_a_forged_reply_is_recomputed_with_the_right_tokens(llama):
    model_dir, prompt, expected = llama
    fake = FakeProducer({"ok": True, "shapes": [[1 << 30, 2]], "dtype": "torch.float32"})
    try:
        with consumer_llm(model_dir) as consumer:
            params = signed(params_for(consumer, prompt, fake.port))
            assert generate(consumer, prompt, params) == expected
            stats = consumer.stats()
            assert stats.num_kv_load_failures == 1 and stats.external_prefix_cache_hits == 0
            assert fake.pulls == 1 and stats.kv_cache_usage == 0
    finally:
        fake.close()


def test_a_line_over_the_bound_is_refused():
    import io

    with pytest.raises(ValueError, match="over 1048576 bytes"):
        read_line(io.BytesIO(b"[" * (2 << 20) + b"\n"))
    with pytest.raises(ValueError, match="not an object"):
        read_line(io.BytesIO(b"[1]\n"))


# ---------------------------------------------------------------------------- concurrency

def test_a_stalled_producer_delays_no_pull_from_another(listener):
    """The listener never accepts (the kernel completes the handshake): a pull from it waits
    until its deadline, while a pull from a good producer, asked after it, is done long
    before."""
    port = free_port()
    producer = worker("kv_producer", port)
    consumer = worker("kv_consumer", fill=False, pull_timeout_s=4, connect_timeout_s=30,
                      transfer_timeout_s=30)
    try:
        producer.bind_connector_metadata(P2pMetadata(sends=(Send("h", "sent", ((5, 6),)),)))
        consumer.puller.submit(Pull("stalled", "127.0.0.1", listener.port, "x", ((1,),),
                                    ((1,),)))
        consumer.puller.submit(Pull("good", "127.0.0.1", port, "h", ((5, 6),), ((2, 3),)))
        reports = wait_reports(consumer, {"stalled", "good"})
        assert reports["good"][0] == "loaded" and reports["stalled"][0] == "failed"
        assert reports["good"][1] < 3 <= reports["stalled"][1] < 10, reports
        read = producer.paged.read(0, [5, 6])
        assert torch.equal(consumer.paged.read(0, [2, 3]), read)
        assert wait_for(lambda: "sent" in producer.get_finished(set())[0])
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_stranger_without_the_secret_is_refused_by_the_producer():
    port = free_port()
    producer = worker("kv_producer", port)
    try:
        with pytest.raises(ValueError, match="not authenticated"):
            Peer.connect("127.0.0.1", port, KEY, 0, b"a-guessed-secret-0000", 5.0, 5.0)
        Peer.connect("127.0.0.1", port, KEY, 0, KV_SECRET.encode(), 5.0, 5.0).close()
    finally:
        producer.shutdown()


def wait_for(predicate, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
