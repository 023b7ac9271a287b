"""`RequestStream`: a reader that keeps up gets every output as it came; past
MAX_PENDING_OUTPUTS unread, later outputs merge into the last one waiting, so a stream whose
reader falls behind holds its text so far and a bounded number of objects, not one per step."""

from __future__ import annotations

import asyncio

from aserve.engine.async_engine import MAX_PENDING_OUTPUTS, EngineDeadError, RequestStream
from aserve.engine.outputs import CompletionOutput, Logprob, RequestOutput


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def delta(index: int, step: int, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index, f"<{index}.{step}>", [step], -float(step),
                            [{step: Logprob(-1.0)}], finish)


def output(step: int, indexes=(0, 1), finished=False, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], prompt_logprobs,
                         [delta(i, step, "length" if finished else None) for i in indexes],
                         finished)


def test_outputs_come_apart_until_the_backlog_is_long_then_merge():
    async def main():
        engine = FakeEngine()
        stream = RequestStream(engine, "r")
        stream.put(output(0, prompt_logprobs=[None, {2: Logprob(-0.5)}]))
        for step in range(1, 1000):
            stream.put(output(step, indexes=(1,) if step % 2 else (0, 1)))
        stream.put(output(1000, finished=True))
        assert len(stream._pending) == MAX_PENDING_OUTPUTS  # whatever the backlog
        outputs = [o async for o in stream]
        assert len(outputs) == MAX_PENDING_OUTPUTS and outputs[-1].finished
        for step, item in enumerate(outputs[:-1]):  # each as it came
            assert [c.token_ids for c in item.outputs if c.index == 1] == [[step]]
        merged = {c.index: c for c in outputs[-1].outputs}
        first = MAX_PENDING_OUTPUTS - 1  # the step whose output took the rest
        assert merged[1].token_ids == list(range(first, 1001))
        assert merged[0].text == "".join(f"<0.{s}>" for s in range(first, 1001)
                                         if s % 2 == 0 or s == 1000)
        assert len(merged[1].logprobs) == 1001 - first and merged[1].cumulative_logprob == -1000
        assert [c.finish_reason for c in outputs[-1].outputs] == ["length", "length"]
        assert outputs[0].prompt_logprobs[1][2].logprob == -0.5
        assert engine.aborted == []  # finished: nothing to abort

    asyncio.run(main())


def test_an_error_comes_after_what_is_pending_and_a_reader_that_leaves_aborts():
    async def main():
        engine = FakeEngine()
        stream = RequestStream(engine, "r")
        stream.put(output(0))
        stream.put(EngineDeadError("gone"))
        seen = []
        try:
            async for item in stream:
                seen.append(item)
        except EngineDeadError:
            pass
        else:
            raise AssertionError("the error was not raised")
        assert len(seen) == 1
        other = RequestStream(engine, "s")
        other.put(output(0))
        reader = other.__aiter__()
        await reader.__anext__()
        await reader.aclose()  # the reader leaves early: the request is aborted
        assert engine.aborted == ["s"]

    asyncio.run(main())
