"""Disaggregated prefill offline: a producer `LLM` prefills (max_tokens=1, do_remote_decode), a
consumer `LLM` decodes with the producer's `kv_transfer_params`, through each connector.

Greedy tokens equal HF's and a single LLM's; the consumer computed only the tail (its step
log's prefill tokens and its external hits say so); both sides hold no block afterwards. The
faults: a cold store, a store written by another model, a producer that is gone, a consumer
that never pulls (the producer's lease). Block size 4: prompts of 21 and 40 tokens end inside
and at a block's end.
"""

from __future__ import annotations

import random
import shutil
import socket
import time

import pytest
from helpers.disagg import KV_SECRET, ProducerProcess
from helpers.hf_models import hf_greedy
from helpers.server import free_port

from aserve import LLM, SamplingParams

NUM_NEW = 12
BS = 4
PROMPT_LENS = (21, 40)


def prompts_for(vocab: int = 500, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, **extra)


def storage(path, role: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def p2p(role: str, port: int, **extra) -> dict:
    return {"kv_connector": "P2pConnector", "kv_role": role, "kv_port": port,
            "kv_connector_extra_config": {"secret": KV_SECRET, **extra}}


def make_llm(model_dir, kv_transfer_config=None, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", block_size=BS,
               kv_transfer_config=kv_transfer_config, **kwargs)


def prefill(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    """The producer's part: one token per prompt, the params a consumer needs."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=1,
                                          kv_transfer_params={"do_remote_decode": True}))
    params = [o.kv_transfer_params for o in outputs]
    assert all(p is not None and p["do_remote_prefill"] for p in params), params
    return params


def decode(llm: LLM, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [greedy(kv_transfer_params=k) for k in params])
    assert all(o.kv_transfer_params is None for o in outputs)  # a consumer returns none
    return [o.outputs[0].token_ids for o in outputs]


def num_prefill_tokens(llm: LLM) -> int:
    return sum(prefill for _, prefill, _, _ in llm.engine_core.step_log.snapshot())


def worker_connector(llm: LLM):
    """Rank 0's worker side of the LLM's KV connector (its sockets live there)."""
    return llm.engine_core.executor.worker.runner.kv_connector


@pytest.fixture(scope="module")
def llama(model_dir_factory):
    model_dir = model_dir_factory("llama")
    prompts = prompts_for()
    return model_dir, prompts, hf_greedy(model_dir, prompts, NUM_NEW)


def test_shared_storage_consumer_decodes_what_a_single_llm_and_hf_do(llama, tmp_path):
    model_dir, prompts, expected = llama
    with make_llm(model_dir) as single:
        assert decode(single, prompts, [None] * len(prompts)) == expected
    with make_llm(model_dir, storage(tmp_path, "kv_producer")) as producer:
        params = prefill(producer, prompts)
        assert producer.stats().kv_cache_usage == 0  # nothing held: the store has it
    with make_llm(model_dir, storage(tmp_path, "kv_consumer")) as consumer:
        assert decode(consumer, prompts, params) == expected
        stats = consumer.stats()
        loaded = sum((n - 1) // BS * BS for n in PROMPT_LENS)  # never the last token's block
        assert stats.external_prefix_cache_hits == loaded and stats.num_kv_load_failures == 0
        assert num_prefill_tokens(consumer) == sum(PROMPT_LENS) - loaded
        assert stats.kv_cache_usage == 0 and stats.kv_transfer_bytes > 0


def test_cold_store_consumer_recomputes_and_is_still_right(llama, tmp_path):
    model_dir, prompts, expected = llama
    with make_llm(model_dir, storage(tmp_path, "kv_consumer")) as consumer:
        assert decode(consumer, prompts, [None] * len(prompts)) == expected
        assert consumer.stats().external_prefix_cache_hits == 0
        assert num_prefill_tokens(consumer) == sum(PROMPT_LENS)


def test_blocks_stored_by_another_model_are_never_loaded(llama, model_dir_factory, tmp_path):
    model_dir, prompts, _ = llama
    other_dir = model_dir_factory("llama", seed=1)  # the same config, other weights
    other_expected = hf_greedy(other_dir, prompts, NUM_NEW)
    assert other_expected != llama[2]
    with make_llm(model_dir, storage(tmp_path, "kv_producer")) as producer:
        prefill(producer, prompts)
    with make_llm(other_dir, storage(tmp_path, "kv_consumer")) as consumer:
        assert decode(consumer, prompts, [None] * len(prompts)) == other_expected
        assert consumer.stats().external_prefix_cache_hits == 0  # another key, other files
        # the first model's files copied under the second's key: found, refused on load
        (key_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        shutil.copytree(key_dir, tmp_path / consumer.model_info.kv_cache_key)
        consumer.reset_prefix_cache()
        assert decode(consumer, prompts, [None] * len(prompts)) == other_expected
        stats = consumer.stats()
        assert stats.external_prefix_cache_hits == 0
        assert stats.num_kv_load_failures == len(prompts)


def test_p2p_consumer_pulls_the_whole_prompt_and_the_producer_frees_it(llama):
    model_dir, prompts, expected = llama
    with make_llm(model_dir, p2p("kv_producer", free_port())) as producer, \
            make_llm(model_dir, p2p("kv_consumer", free_port())) as consumer:
        params = prefill(producer, prompts)
        assert producer.stats().kv_cache_usage > 0  # held for the consumer
        assert decode(consumer, prompts, params) == expected
        stats = consumer.stats()
        assert stats.external_prefix_cache_hits == sum(PROMPT_LENS)
        assert num_prefill_tokens(consumer) == len(prompts)  # the last prompt tokens only
        assert producer.wait_for_kv_transfers(timeout=30)
        assert producer.stats().kv_cache_usage == 0 and consumer.stats().kv_cache_usage == 0
        assert producer.stats().kv_transfer_bytes == stats.kv_transfer_bytes > 0
        # both ends of the pull's connection with Nagle off (a consumer's ack, then its next
        # pull, would otherwise wait out the producer's delayed ACK)
        sockets = [peer.sock for peer in worker_connector(consumer).puller.peers()]
        sockets += worker_connector(producer).sender.sockets()
        assert len(sockets) == 2
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


def test_p2p_producer_frees_its_blocks_after_the_lease_when_nobody_pulls(llama):
    model_dir, prompts, expected = llama
    config = p2p("kv_producer", free_port(), lease_timeout_s=0.5)
    with make_llm(model_dir, config) as producer:
        params = prefill(producer, prompts)
        assert producer.stats().kv_cache_usage > 0
        start = time.monotonic()
        assert producer.wait_for_kv_transfers(timeout=30)
        assert time.monotonic() - start >= 0.3
        assert producer.stats().kv_cache_usage == 0
        with make_llm(model_dir, p2p("kv_consumer", free_port())) as late:
            start = time.monotonic()  # an expired handle is refused at once
            assert decode(late, prompts, params) == expected
            assert time.monotonic() - start < 8
            assert late.stats().num_kv_load_failures == len(prompts)


def test_p2p_producer_gone_before_the_pull_the_consumer_recomputes(llama):
    model_dir, prompts, expected = llama
    with make_llm(model_dir, p2p("kv_producer", free_port())) as producer:
        params = prefill(producer, prompts)
    with make_llm(model_dir, p2p("kv_consumer", free_port())) as consumer:
        start = time.monotonic()
        assert decode(consumer, prompts, params) == expected
        assert time.monotonic() - start < 30
        stats = consumer.stats()
        assert stats.num_kv_load_failures == len(prompts)
        assert stats.external_prefix_cache_hits == 0 and stats.kv_cache_usage == 0


def test_p2p_params_of_another_model_or_prompt_are_not_loaded(llama, model_dir_factory):
    model_dir, prompts, expected = llama
    other_dir = model_dir_factory("llama", seed=1)
    with make_llm(model_dir, p2p("kv_producer", free_port())) as producer:
        params = prefill(producer, prompts)
        with make_llm(other_dir, p2p("kv_consumer", free_port())) as consumer:
            decode(consumer, prompts, params)  # another key: refused before any pull
            assert consumer.stats().num_kv_load_failures == len(prompts)
        with make_llm(model_dir, p2p("kv_consumer", free_port())) as consumer:
            swapped = [params[1], params[0]]  # each prompt given the other's blocks
            assert decode(consumer, prompts, swapped) == expected
            assert consumer.stats().num_kv_load_failures == len(prompts)
            assert consumer.reset_prefix_cache()  # (else the recomputed prompts hit here)
            assert decode(consumer, prompts, params) == expected  # the right ones still load
            assert consumer.stats().external_prefix_cache_hits == sum(PROMPT_LENS)


def test_kv_transfer_params_are_checked_against_the_connector(llama, tmp_path):
    model_dir, prompts, _ = llama
    one = [{"prompt_token_ids": prompts[0]}]
    with make_llm(model_dir) as llm:
        with pytest.raises(ValueError, match="kv_transfer_params needs a KV connector"):
            llm.generate(one, SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    with make_llm(model_dir, storage(tmp_path, "kv_consumer")) as llm:
        with pytest.raises(ValueError, match=r"keys \['remote_handle'\]"):
            llm.generate(one, SamplingParams(kv_transfer_params={"remote_handle": "x"}))
        with pytest.raises(ValueError, match="kv_role is kv_consumer"):
            llm.generate(one, SamplingParams(kv_transfer_params={"do_remote_decode": True}))
        with pytest.raises(ValueError, match="n=1 only"):
            llm.generate(one, SamplingParams(n=2, kv_transfer_params={}))
        # vLLM's place for them is accepted too
        out = llm.generate(one, SamplingParams(
            max_tokens=2, extra_args={"kv_transfer_params": {"do_remote_prefill": False}}))
        assert len(out[0].outputs[0].token_ids) == 2
    with make_llm(model_dir, storage(tmp_path, "kv_producer")) as llm:
        with pytest.raises(ValueError, match="do_remote_prefill .* kv_role is kv_producer"):
            llm.generate(one, SamplingParams(kv_transfer_params={"do_remote_prefill": True}))


@pytest.mark.parametrize("connector", ["SharedStorageConnector", "P2pConnector"])
def test_sliding_window_model_through_each_connector(sliding_dir_factory, tmp_path, connector):
    """Gemma-3's sliding layers (W=8) null their early blocks on the producer, which
    prefills in chunks of 8 tokens: the consumer loads per-group blocks, only those still
    read."""
    model_dir = sliding_dir_factory("gemma3")
    prompts = prompts_for(vocab=256)
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    if connector == "P2pConnector":
        produce, consume = p2p("kv_producer", free_port()), p2p("kv_consumer", free_port())
    else:
        produce, consume = storage(tmp_path, "kv_producer"), storage(tmp_path, "kv_consumer")
    with make_llm(model_dir, produce, max_num_batched_tokens=8) as producer, \
            make_llm(model_dir, consume) as consumer:
        params = prefill(producer, prompts)
        if connector == "P2pConnector":
            assert 0 in params[1]["remote_block_ids"][1]  # a sliding group's nulled block
        assert decode(consumer, prompts, params) == expected
        stats = consumer.stats()
        assert stats.external_prefix_cache_hits > 0 and stats.num_kv_load_failures == 0
        assert producer.wait_for_kv_transfers(timeout=30)
        assert producer.stats().kv_cache_usage == 0 and stats.kv_cache_usage == 0


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["SharedStorageConnector", "P2pConnector"])
def test_tp2_producer_and_consumer_move_each_ranks_heads(llama, tmp_path, connector):
    """Each rank moves its own kv heads (a rank's files, a rank's pull); rank 0 counts a
    transfer finished once both ranks have reported it. The producer runs in a process of
    its own (one default process group per process)."""
    model_dir, prompts, expected = llama
    if connector == "P2pConnector":
        produce, consume = p2p("kv_producer", free_port()), p2p("kv_consumer", free_port())
    else:
        produce, consume = storage(tmp_path, "kv_producer"), storage(tmp_path, "kv_consumer")
    kwargs = dict(dtype="float32", block_size=BS, tensor_parallel_size=2)
    producer = ProducerProcess(model_dir, dict(kwargs, kv_transfer_config=produce), prompts)
    try:
        params = producer.params()
        with LLM(str(model_dir), kv_transfer_config=consume, **kwargs) as consumer:
            assert decode(consumer, prompts, params) == expected
            stats = consumer.stats()
            loaded = (sum(PROMPT_LENS) if connector == "P2pConnector"
                      else sum((n - 1) // BS * BS for n in PROMPT_LENS))
            assert stats.external_prefix_cache_hits == loaded
            assert stats.num_kv_load_failures == 0 and stats.kv_cache_usage == 0
        assert producer.finish() == (True, 0.0)
    finally:
        producer.kill()
    if connector == "SharedStorageConnector":
        names = {p.name.split(".")[1] for p in tmp_path.rglob("*.safetensors")}
        assert names == {"rank0", "rank1"}


def test_p2p_consumer_gone_mid_transfer_gives_the_blocks_back_before_the_lease(llama):
    """A consumer rank that asks for blocks and hangs up without taking them: the producer
    frees them at once (not after its 120 s lease), and a second pull of the handle is
    refused at once."""
    from aserve.kv_transfer.p2p_wire import Peer, read_line, write_line

    model_dir, prompts, _ = llama
    port = free_port()
    config = p2p("kv_producer", port, transfer_timeout_s=3.0)
    with make_llm(model_dir, config) as producer:
        params = prefill(producer, prompts[:1])[0]

        consumer = ("127.0.0.1", port, params["remote_kv_cache_key"], 0, KV_SECRET.encode(),
                    5.0, 3.0)
        start = time.monotonic()
        peer = Peer.connect(*consumer)
        write_line(peer.stream, {"handle": params["remote_handle"],
                                 "block_ids": params["remote_block_ids"]})
        assert read_line(peer.stream)["ok"]
        peer.close()  # gone before receiving anything
        assert producer.wait_for_kv_transfers(timeout=30)
        assert time.monotonic() - start < 30 and producer.stats().kv_cache_usage == 0
        again = Peer.connect(*consumer)
        write_line(again.stream, {"handle": params["remote_handle"], "block_ids": [[]]})
        reply = read_line(again.stream)
        assert not reply["ok"] and "unknown or expired" in reply["error"]
        again.close()


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft_model",
], ids=["ngram", "draft_model"])
def test_a_speculating_consumer_decodes_what_hf_does(llama, monkeypatch, spec):
    """A consumer that speculates: the prompt's K/V comes from the producer, drafts are
    verified over it (a draft model, here the target itself, has no K/V of the loaded prefix:
    its drafts there are worse, never wrong); greedy as HF's, every block given back."""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)
    model_dir, prompts, expected = llama
    if spec == "draft_model":
        spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    with make_llm(model_dir, p2p("kv_producer", free_port())) as producer, \
            make_llm(model_dir, p2p("kv_consumer", free_port()),
                     speculative_config=spec) as consumer:
        params = prefill(producer, prompts)
        assert decode(consumer, prompts, params) == expected
        stats = consumer.stats()
        assert stats.external_prefix_cache_hits == sum(PROMPT_LENS)
        assert stats.spec_decode_num_draft_tokens > 0
        assert stats.kv_cache_usage == 0
