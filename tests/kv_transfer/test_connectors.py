"""The connectors' parts without an engine: the config's checks, the KV cache key, whole-block
reads and writes over KV cache groups, rank 0's count of every rank's reports, the shared
store's lookup, and what a P2P consumer refuses before it pulls."""

from __future__ import annotations

import pytest
import torch
from helpers.disagg import KV_SECRET
from helpers.requests import make_request

from aserve.config import KVCacheGroupSpec, KVTransferConfig
from aserve.core.kv_connector import KVConnectorOutput
from aserve.kv_transfer import (
    KVConnectorRole,
    PagedKV,
    RankReports,
    check_config,
    create_connector,
    kv_cache_key,
    model_identity,
)
from aserve.kv_transfer.base import prompt_digest
from aserve.kv_transfer.p2p_auth import sign_params

BS = 4


@pytest.mark.parametrize("value, message", [
    ("[1]", "must be a JSON object"),
    ('{"kv_role": "kv_both"}', "needs kv_connector"),
    ({"kv_connector": "P2pConnector", "kv_port": 0}, "kv_port must be a TCP port"),
    ({"kv_connector": "P2pConnector", "kv_connector_extra_config": {"lease": 3}},
     "does not know"),
    ({"kv_connector": "P2pConnector", "kv_connector_extra_config": {"lease_timeout_s": -1}},
     "positive number"),
    ({"kv_connector": "P2pConnector",
      "kv_connector_extra_config": {"secret": KV_SECRET, "pull_timeout_s": "1"}},
     "pull_timeout_s must be a positive number"),
    ({"kv_connector": "P2pConnector"}, "ASERVE_KV_SECRET"),
    ({"kv_connector": "P2pConnector", "kv_connector_extra_config": {"secret": 123}},
     "secret must be a string"),
    ({"kv_connector": "P2pConnector", "kv_connector_extra_config": {"secret": "short"}},
     "at least 16 characters"),
    ({"kv_connector": "P2pConnector",
      "kv_connector_extra_config": {"secret": KV_SECRET, "producers": "10.0.0.1:14579"}},
     "producers must be a non-empty list"),
    ({"kv_connector": "P2pConnector",
      "kv_connector_extra_config": {"secret": KV_SECRET, "producers": ["10.0.0.1"]}},
     "host:port"),
    ({"kv_connector": "SharedStorageConnector",
      "kv_connector_extra_config": {"shared_storage_path": ""}}, "shared_storage_path"),
])
def test_bad_configs_are_refused_naming_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        check_config(KVTransferConfig.from_value(value))


def test_vllm_keys_are_accepted_and_roles_read(tmp_path):
    config = KVTransferConfig.from_value({
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer", "kv_rank": 1,
        "kv_parallel_size": 2, "kv_buffer_device": "cuda", "kv_buffer_size": 1e9,
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "new" / "dir")}})
    check_config(config)
    assert (tmp_path / "new" / "dir").is_dir()  # created at startup
    assert config.is_consumer and not config.is_producer


def test_the_kv_cache_key_follows_weights_dtype_and_layout(model_dir_factory):
    a, b = model_dir_factory("llama"), model_dir_factory("llama", seed=1)
    assert model_identity(a) != model_identity(b)  # one config, other weights
    base = (a, "torch.float32", BS, 1, 2, 16, (None, None))
    assert kv_cache_key(*base) == kv_cache_key(*base)
    for changed in ((b, *base[1:]), (a, "torch.bfloat16", *base[2:]), (*base[:3], 2, 1, 16,
                    base[6]), (*base[:6], (None, 8))):
        assert kv_cache_key(*changed) != kv_cache_key(*base), changed


def test_paged_kv_moves_whole_blocks_of_one_group():
    # layers 0, 2 full (group 0), 1, 3 sliding (group 1): buffers 0 and 1 shared by the groups
    groups = (KVCacheGroupSpec((0, 2), None, BS), KVCacheGroupSpec((1, 3), 8, BS))
    buffers = [torch.randn(2, 6, BS, 2, 3) for _ in range(2)]
    caches = {0: buffers[0], 1: buffers[0], 2: buffers[1], 3: buffers[1]}
    paged = PagedKV(caches, groups)
    data = paged.read(0, [4, 1])
    assert data.shape == (2, 2, 2, BS, 2, 3) and paged.block_shape(0) == (2, 2, 1, BS, 2, 3)
    assert torch.equal(data[1, :, 0], buffers[1][:, 4])
    paged.write(1, [5, 2], data)
    assert torch.equal(buffers[0][:, 5], buffers[0][:, 4]) and torch.equal(
        buffers[1][:, 2], buffers[1][:, 1])
    with pytest.raises(ValueError, match="for 2 layers and 3 blocks"):
        paged.write(1, [0, 1, 2], data)


def test_rank_reports_count_a_request_once_every_rank_has_reported_it():
    reports = RankReports(world_size=2)
    step = reports.combine([KVConnectorOutput(finished_recving={"a"}, num_bytes=10),
                            KVConnectorOutput(finished_sending={"s"}, num_bytes=5)])
    assert step == KVConnectorOutput(num_bytes=15)  # each half-reported
    step = reports.combine([KVConnectorOutput(finished_sending={"s"}, failed_recving={"b"}),
                            KVConnectorOutput(finished_recving={"a", "b"})])
    assert step.finished_recving == {"a"} and step.finished_sending == {"s"}
    assert step.failed_recving == {"b"}  # one rank failed it: failed


def storage_connector(tmp_path, role: str = "kv_consumer", tp_size: int = 1):
    config = KVTransferConfig.from_value({
        "kv_connector": "SharedStorageConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    groups = (KVCacheGroupSpec((0,), None, BS),)
    return create_connector(config, KVConnectorRole.SCHEDULER, "k" * 32, groups, BS, 0,
                            tp_size)


def test_the_store_offers_the_run_of_blocks_every_rank_has_never_the_last_token(tmp_path):
    connector = storage_connector(tmp_path, tp_size=2)
    request = make_request("r", list(range(12)))  # blocks 0-2; block 2 holds the last token
    connector.get_num_new_matched_tokens(request, 0)  # (hashes the prompt)
    hashes = [h.hex() for h in request.block_hashes]
    for index, ranks in ((0, (0, 1)), (1, (0, 1)), (2, (0, 1)), (3, (0,))):
        for rank in ranks:
            if index < len(hashes):
                path = connector.block_path(hashes[index], rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"")
    assert connector.get_num_new_matched_tokens(request, 0) == (8, True)
    assert connector.get_num_new_matched_tokens(request, 4) == (4, True)
    connector.block_path(hashes[1], 1).unlink()  # a rank lacks block 1: the run ends there
    assert connector.get_num_new_matched_tokens(request, 0) == (4, True)
    producer = storage_connector(tmp_path, role="kv_producer")
    assert producer.get_num_new_matched_tokens(request, 0) == (0, True)


def p2p_consumer(groups, **extra):
    config = KVTransferConfig.from_value({
        "kv_connector": "P2pConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"secret": KV_SECRET, **extra}})
    return create_connector(config, KVConnectorRole.SCHEDULER, "k" * 32, groups, BS)


def producer_params(prompt: list[int], block_ids, secret: str = KV_SECRET, **changes) -> dict:
    """What a producer holding `secret` would answer (with `changes`), signed."""
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_handle": "h", "remote_block_ids": block_ids,
              "remote_num_tokens": len(prompt), "remote_prompt_hash": prompt_digest(prompt),
              "remote_kv_cache_key": "k" * 32, "tp_size": 1, **changes}
    return {**params, "remote_signature": sign_params(params, secret.encode())}


@pytest.mark.parametrize("changes, reason", [
    ({}, None),
    ({"remote_kv_cache_key": "x" * 32}, "model, dtype, block size or TP layout"),
    ({"tp_size": 2}, "TP size"),
    ({"remote_prompt_hash": "0" * 32}, "another prompt"),
    ({"remote_block_ids": [[1, 2, 3]]}, "do not cover the prompt"),
    # W = 6: position 9's window starts in block 1, which the producer had nulled
    ({"remote_block_ids": [[1, 2, 3], [0, 0, 6]]}, "no longer holds group 1"),
])
def test_a_p2p_consumer_checks_the_producer_before_it_pulls(changes, reason):
    groups = (KVCacheGroupSpec((0,), None, BS), KVCacheGroupSpec((1,), 6, BS))
    connector = p2p_consumer(groups)
    prompt = list(range(10))
    params = producer_params(prompt, [[1, 2, 3], [0, 5, 6]], **changes)
    request = make_request("r", prompt, kv_transfer_params=params)
    assert connector.get_num_new_matched_tokens(request, 0) == (10, True)
    connector.update_state_after_alloc(request, ([7, 8, 9], [10, 11, 12]), 10)
    (pull,) = connector.build_connector_meta(None).pulls
    assert pull.error == reason or (reason and reason in pull.error)
    if reason is None:  # the nulled block is not moved: its window never reads it
        assert pull.remote_ids == ((1, 2, 3), (5, 6)) and pull.local_ids == ((7, 8, 9),
                                                                            (11, 12))
    assert connector.get_num_new_matched_tokens(request, 0) == (0, True)  # once


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2},
                                    {"sequence_parallel_size": 2}])
def test_a_connector_under_pipeline_or_sequence_parallelism_is_refused(tmp_path, layout):
    from aserve.engine.arg_utils import EngineArgs, KVTransferConfigError

    config = {"kv_connector": "SharedStorageConnector",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    with pytest.raises(KVTransferConfigError, match="pipeline or sequence parallelism"):
        EngineArgs(model="unused", kv_transfer_config=config, **layout)
    EngineArgs(model="unused", kv_transfer_config=config)  # one rank: fine
