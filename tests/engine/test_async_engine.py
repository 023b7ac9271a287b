"""The engine thread and its asyncio actor: streams, aborts, failures, and the mailboxes."""

from __future__ import annotations

import asyncio

import pytest

from aserve import LLM, SamplingParams
from aserve.engine.arg_utils import EngineArgs
from aserve.engine.async_engine import AsyncEngine, EngineDeadError


def run(coro):
    return asyncio.run(coro)


async def started(model_dir, **kwargs) -> AsyncEngine:
    engine = AsyncEngine(EngineArgs(model=str(model_dir), dtype="float32", **kwargs))
    await engine.start()
    return engine


async def collect(engine: AsyncEngine, request_id: str, prompt, params) -> dict[int, dict]:
    """Concatenate the streamed deltas of each completion."""
    result: dict[int, dict] = {}
    async for output in engine.generate(request_id, prompt, params):
        for delta in output.outputs:
            entry = result.setdefault(delta.index, {"text": "", "token_ids": []})
            entry["text"] += delta.text
            entry["token_ids"] += delta.token_ids
            entry["finish_reason"] = delta.finish_reason
    return result


def test_streamed_deltas_add_up_to_the_offline_output(model_dir_factory):
    model_dir = model_dir_factory("llama")
    prompts = ["Hello! How are you?", "中文文本测试：你好", "The quick brown fox"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    offline = LLM(str(model_dir), dtype="float32").generate(prompts, params)

    async def main():
        engine = await started(model_dir)
        try:
            results = await asyncio.gather(*(
                collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
            return results, engine.stats
        finally:
            await engine.shutdown()

    results, stats = run(main())
    for out, streamed in zip(offline, results):
        assert streamed[0]["token_ids"] == out.outputs[0].token_ids
        assert streamed[0]["text"] == out.outputs[0].text
        assert streamed[0]["finish_reason"] == "length"
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0


def test_n_completions_stream_with_their_indices(model_dir_factory):
    async def main():
        engine = await started(model_dir_factory("llama"))
        try:
            return await collect(engine, "r", "Hello", SamplingParams(
                n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
        finally:
            await engine.shutdown()

    result = run(main())
    assert sorted(result) == [0, 1, 2]
    assert all(len(r["token_ids"]) == 8 for r in result.values())


def test_leaving_a_stream_early_aborts_and_frees_blocks(model_dir_factory):
    async def main():
        engine = await started(model_dir_factory("llama"))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            stream = await engine.add_request("r", "Hello", params)
            async for _ in stream:
                break  # the client goes away after the first delta
            for _ in range(200):
                await asyncio.sleep(0.01)
                if engine.stats.num_running_reqs == 0 and engine.stats.kv_cache_usage == 0:
                    break
            follow_up = await collect(engine, "r2", "Hello", SamplingParams(
                temperature=0.0, max_tokens=4, ignore_eos=True))
            return engine.stats, follow_up
        finally:
            await engine.shutdown()

    stats, follow_up = run(main())
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0
    assert len(follow_up[0]["token_ids"]) == 4


def test_invalid_requests_raise_before_reaching_the_engine(model_dir_factory):
    async def main():
        engine = await started(model_dir_factory("llama"), max_model_len=64)
        try:
            with pytest.raises(ValueError, match="maximum context length"):
                await engine.add_request("a", {"prompt_token_ids": [5] * 100}, SamplingParams())
            with pytest.raises(ValueError, match="out of vocabulary"):
                await engine.add_request("b", {"prompt_token_ids": [10**7]}, SamplingParams())
            assert engine.inbox.empty() and not engine.streams
        finally:
            await engine.shutdown()

    run(main())


def test_an_engine_thread_failure_fails_in_flight_requests_and_marks_it_dead(
        model_dir_factory, monkeypatch):
    from aserve.runner.worker import Worker

    async def main():
        engine = await started(model_dir_factory("llama"))
        stream = await engine.add_request("r", "Hello", SamplingParams(
            max_tokens=500, ignore_eos=True))
        first = await stream.get()  # the engine is running this request
        assert not first.finished

        def boom(self, scheduler_output):
            raise RuntimeError("injected failure")

        # The next step fails inside the engine thread.
        monkeypatch.setattr(Worker, "execute_model", boom)
        with pytest.raises(EngineDeadError, match="injected failure"):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("r2", "Hello", SamplingParams())
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_a_missing_model_fails_start(tmp_path, model_dir_factory):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir_factory("llama"), broken)
    (broken / "config.json").unlink()

    async def main():
        engine = AsyncEngine(EngineArgs(model=str(broken)))
        with pytest.raises(EngineDeadError, match="config.json"):
            await engine.start()

    run(main())
