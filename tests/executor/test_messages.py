"""The rank protocol: rank messages are frozen dataclasses dispatched by type, and rank 0 hands
step inputs to the other ranks through the runner's constructor (no monkey-patching)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from aserve.config import KVCacheGroupSpec
from aserve.core.kv_connector import KVConnectorOutput
from aserve.executor import messages as rank_messages
from aserve.executor.messages import (
    InitKVCache,
    KVConnectorReport,
    KVConnectorStep,
    ProfileRun,
    RunStep,
    Stop,
    handle,
)
from aserve.executor.spec import RankLayout, WorkerSpec
from aserve.runner.input_batch import PreparedInputs


class FakeRunner:
    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.kv_connector = None

    def run_rank_step(self, inputs, kv_metadata) -> KVConnectorOutput:
        self.calls.append(("run_rank_step", inputs, kv_metadata))
        return KVConnectorOutput(finished_recving={f"loaded-{kv_metadata}"})

    def run_model(self, inputs) -> None:
        self.calls.append(("run_model", inputs))

    def profile_run(self, num_tokens: int, num_reqs: int) -> None:
        self.calls.append(("profile_run", num_tokens, num_reqs))


class FakeWorker:
    def __init__(self) -> None:
        self.calls: list = []
        self.runner = FakeRunner(self.calls)

    def initialize_kv_cache(self, num_blocks: int, kv_cache_groups) -> None:
        self.calls.append(("initialize_kv_cache", num_blocks, kv_cache_groups))


def inputs() -> PreparedInputs:
    ids = np.array([3, 4, 5], dtype=np.int64)
    return PreparedInputs(ids, np.arange(3), np.array([0, 3], dtype=np.int32),
                          np.array([3], dtype=np.int32), [np.zeros((1, 1), dtype=np.int32)],
                          [np.arange(3)], 3, 3, [0], np.array([2]), [])


GROUPS = (KVCacheGroupSpec((0, 2), None), KVCacheGroupSpec((1, 3), 8))


def test_each_message_reaches_its_handler_and_stop_ends_the_loop():
    worker, step = FakeWorker(), inputs()
    messages = [ProfileRun(64, 4), InitKVCache(10, GROUPS), RunStep(step), RunStep(step), Stop()]
    served = [handle(worker, m) for m in messages]
    assert served == [True, True, True, True, False]
    assert worker.calls == [("profile_run", 64, 4), ("initialize_kv_cache", 10, GROUPS),
                            ("run_model", step), ("run_model", step)]


def test_with_a_kv_connector_each_step_is_answered_with_a_report(monkeypatch):
    """RunStep carries the connector's metadata, KVConnectorStep is a step without a
    forward; after either, the rank sends rank 0 its KVConnectorReport."""
    sent = []
    monkeypatch.setattr(rank_messages, "send_to_first_rank", sent.append)
    worker, step = FakeWorker(), inputs()
    worker.runner.kv_connector = object()
    assert handle(worker, RunStep(step, "m1")) and handle(worker, KVConnectorStep("m2"))
    assert worker.calls == [("run_rank_step", step, "m1"), ("run_rank_step", None, "m2")]
    assert sent == [KVConnectorReport(KVConnectorOutput(finished_recving={"loaded-m1"})),
                    KVConnectorReport(KVConnectorOutput(finished_recving={"loaded-m2"}))]
    back = pickle.loads(pickle.dumps(sent[0], protocol=5))
    assert back == sent[0]


def test_anything_else_is_refused_by_type():
    with pytest.raises(TypeError, match="not a rank message"):
        handle(FakeWorker(), ("step", inputs()))  # the old string-tagged tuples


def test_messages_are_frozen_and_survive_the_control_channel_pickle():
    message = RunStep(inputs())
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.inputs = None
    back = pickle.loads(pickle.dumps(message, protocol=5))
    assert type(back) is RunStep and back.inputs.input_ids.tolist() == [3, 4, 5]
    assert pickle.loads(pickle.dumps(InitKVCache(7, GROUPS))) == InitKVCache(7, GROUPS)


def test_rank_layout_places_ranks_stage_major_over_nodes():
    layout = RankLayout(world_size=4, tp_size=2, nnodes=2, master_port=1234)
    configs = [layout.config(node, local) for node in (0, 1) for local in (0, 1)]
    assert [c.rank for c in configs] == [0, 1, 2, 3]
    assert [c.local_rank for c in configs] == [0, 1, 0, 1]
    assert RankLayout(world_size=2, tp_size=2).with_port().master_port > 0
    with pytest.raises(ValueError, match="master port"):
        RankLayout(world_size=2, tp_size=2).config(0, 1)


def test_one_spec_builds_a_single_rank_worker(llama_dir):
    spec = WorkerSpec(_model_config(llama_dir), block_size=16, device="cpu")
    worker = spec.build()
    assert worker.runner.publish_inputs is None
    published = []
    worker = spec.build(publish_inputs=published.append)
    assert worker.runner.publish_inputs == published.append


def _model_config(model_dir):
    from aserve.config import ModelConfig

    return ModelConfig(str(model_dir), dtype="float32")
