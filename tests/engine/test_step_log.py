"""The engine's `StepLog`: one record per step that computed tokens, prefill and decode apart,
the newest few hundred kept."""

from __future__ import annotations

from aserve import LLM, SamplingParams
from aserve.engine.step_log import StepLog


def test_keeps_the_newest_steps_oldest_first():
    log = StepLog(capacity=3)
    for k in range(5):
        log.record(k, 1, 0.5)
    steps = log.snapshot()
    assert [s[1] for s in steps] == [2, 3, 4]
    assert [s[0] for s in steps] == sorted(s[0] for s in steps)  # times in order


def test_the_engine_records_each_step_as_prefill_and_decode_tokens(model_dir_factory):
    llm = LLM(model_dir_factory("llama"), dtype="float32", max_model_len=256,
              max_num_batched_tokens=8, async_scheduling=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 25))}], params)  # 20 tokens: 3 chunks
    steps = llm.engine_core.step_log.snapshot()
    assert [(prefill, decode) for _, prefill, decode, _ in steps] == [
        (8, 0), (8, 0), (4, 0), (0, 1), (0, 1), (0, 1)]
    assert all(seconds > 0 for *_, seconds in steps)
