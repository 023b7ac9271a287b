"""`RequestStream`: outputs its reader has not taken are merged into one, so a stream whose
reader falls behind holds its text so far, not an object per engine step."""

from __future__ import annotations

import asyncio

from aserve.engine.async_engine import EngineDeadError, RequestStream
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


def test_unread_outputs_merge_into_one_per_choice():
    async def main():
        engine = FakeEngine()
        stream = RequestStream(engine, "r")
        stream.put(output(0, prompt_logprobs=[None, {2: Logprob(-0.5)}]))
        for step in range(1, 1000):
            stream.put(output(step, indexes=(1,) if step % 2 else (0, 1)))
        merged = await stream.get()
        assert stream._pending is None  # one object held, whatever the backlog
        texts = {c.index: c for c in merged.outputs}
        assert texts[0].text == "".join(f"<0.{s}>" for s in range(0, 1000, 2))
        assert texts[1].token_ids == list(range(1000))
        assert len(texts[1].logprobs) == 1000 and texts[1].cumulative_logprob == -999.0
        assert merged.prompt_logprobs[1][2].logprob == -0.5  # the first output's, kept
        stream.put(output(1000, finished=True))
        rest = [o async for o in stream]
        assert len(rest) == 1 and rest[0].finished
        assert [c.finish_reason for c in rest[0].outputs] == ["length", "length"]
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
