"""A KV connector's part of each step (`runner/kv_connector_hooks.py`): the connector's hooks in
vLLM's order around the forward, every rank's report combined on rank 0, a step without
tokens told to the other ranks; and without a connector, the no-op: nothing told, no report."""

from __future__ import annotations

import torch

from aserve.config import ModelConfig
from aserve.core.kv_cache_utils import make_kv_cache_groups
from aserve.core.kv_connector import KVConnectorOutput
from aserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from aserve.runner.kv_connector_hooks import NO_OP_KV_CONNECTOR, KVConnectorHooks
from aserve.runner.worker import Worker


class RecordingConnector:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args))

    def step_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self.calls.append(("step_output", finished_req_ids))
        return KVConnectorOutput(finished_recving={"both"}, finished_sending={"rank0-only"})


def test_a_step_without_tokens_runs_the_hooks_on_every_rank_and_combines_their_reports():
    connector, published = RecordingConnector(), []
    other_rank = KVConnectorOutput(finished_recving={"both"})
    hooks = KVConnectorHooks(connector, {3: torch.zeros(1), 5: torch.ones(1)},
                             lambda *args: published.append(args), lambda: [other_rank])
    output = hooks.step_without_forward("meta", {"done"})
    assert published == [(None, "meta")]  # → KVConnectorStep to the other ranks
    assert [c[:2] for c in connector.calls] == [
        ("bind_connector_metadata", "meta"), ("start_load_kv",), ("wait_for_layer_load", 3),
        ("wait_for_layer_load", 5), ("save_kv_layer", 3), ("save_kv_layer", 5),
        ("wait_for_save",), ("step_output", {"done"}), ("clear_connector_metadata",)]
    # finished once every rank (2) has reported it
    assert output.finished_recving == {"both"} and not output.finished_sending


def test_a_rank_above_0_reports_its_own_output_uncombined():
    connector = RecordingConnector()
    hooks = KVConnectorHooks(connector, {0: torch.zeros(1)}, None, None)
    hooks.before_forward("meta")
    assert hooks.after_forward(set(), gather=False).finished_sending == {"rank0-only"}


def test_the_no_op_connector_does_nothing_and_reports_none():
    assert NO_OP_KV_CONNECTOR.connector is None
    NO_OP_KV_CONNECTOR.before_forward("meta")
    assert NO_OP_KV_CONNECTOR.after_forward({"a"}, gather=True) is None
    assert NO_OP_KV_CONNECTOR.step_without_forward("meta", {"a"}) is None


def test_without_a_connector_a_step_without_tokens_tells_no_rank_and_reports_nothing(
        model_dir_factory):
    published = []
    worker = Worker(ModelConfig(str(model_dir_factory("llama")), dtype="float32"), 16, "cpu",
                    publish_inputs=lambda *args: published.append(args))
    groups = make_kv_cache_groups(worker.runner.arch.layer_windows, 16)
    worker.initialize_kv_cache(8, groups)
    runner = worker.runner
    assert runner.kv_connector is None
    step = runner.start_step(SchedulerOutput([], [], {}, 0, finished_req_ids={"gone"}))
    assert runner.finish_step(step) == ModelRunnerOutput([], []) and not published
