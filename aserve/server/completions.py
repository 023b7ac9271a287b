"""`POST /v1/completions`: one or many prompts (text or token ids), `n` choices each, plain JSON
or a server-sent-event stream of deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.server.protocol import (
    CompletionRequest,
    make_id,
)
from aserve.server.responses import (
    CompletionChoice,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
    completion_logprobs,
)
from aserve.server.serving import (
    Generation,
    check_model,
    collect_or_abort,
    event_stream,
    merged_outputs,
    parse_body,
    prepare,
    process_prompt,
    running_engine,
    sampling_params_of,
    server_state,
    start_generations,
)


@dataclass
class Choice:
    """One choice being assembled from deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def create_completion(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    check_model(request, body.model)
    engine = running_engine(request)
    prompts = [await process_prompt(engine, p, body.add_special_tokens, body.cache_salt)
               for p in body.prompts()]
    params = sampling_params_of(body)
    prepared = [await prepare(engine, p, params, body) for p in prompts]
    request_id = make_id("cmpl")
    generations = start_generations(request, engine, request_id, prepared)
    view = CompletionView(body, server_state(request).model_name, request_id, engine.tokenizer)
    if body.stream:
        return event_stream(request, view.stream(generations), generations)
    results = await collect_or_abort(request, generations)
    return JSONResponse(view.response(generations, results).model_dump())


class CompletionView:
    """Turns engine deltas into OpenAI's completion objects for one HTTP request."""

    def __init__(self, body: CompletionRequest, model: str, request_id: str, tokenizer) -> None:
        self.body, self.model, self.request_id = body, model, request_id
        self.tokenizer = tokenizer
        self.n = body.n or 1

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_text(self, generation: Generation) -> str:
        prompt = generation.prompt
        return prompt.prompt if prompt.prompt is not None else self.tokenizer.decode(
            prompt.prompt_token_ids, skip_special_tokens=False)

    def echo_prefix(self, generation: Generation, prompt_logprobs
                    ) -> tuple[str, list[int], list[dict[int, Logprob] | None]]:
        """Text, token ids and logprobs of the echoed prompt (nothing without `echo`)."""
        if not self.body.echo:
            return "", [], []
        ids = generation.prompt.prompt_token_ids
        return self.prompt_text(generation), ids, list(prompt_logprobs or [None] * len(ids))

    def generated(self, delta: CompletionOutput) -> CompletionOutput:
        """What of a delta the response shows: all of it, or with `max_tokens: 0` none of the
        token the engine decoded (`CompletionRequest.scores_only`): the choice ends at the
        prompt, for its length."""
        if not self.body.scores_only:
            return delta
        ended = delta.finish_reason in ("stop", "length")  # (an abort stays one)
        return replace(delta, text="", token_ids=[], logprobs=None, stop_reason=None,
                       finish_reason="length" if ended else delta.finish_reason)

    def logprobs_of(self, token_ids, logprobs, offset: int):
        if self.body.logprobs is None:
            return None
        return completion_logprobs(token_ids, logprobs, self.decode, offset)

    def response(self, generations: list[Generation],
                 results: list[list[RequestOutput]]) -> CompletionResponse:
        choices, num_generated = [], 0
        for gi, (generation, outputs) in enumerate(zip(generations, results)):
            assembled = [Choice() for _ in range(self.n)]
            for output in outputs:
                for delta in map(self.generated, output.outputs):
                    choice = assembled[delta.index]
                    choice.text += delta.text
                    choice.token_ids += delta.token_ids
                    choice.logprobs += delta.logprobs or [None] * len(delta.token_ids)
                    choice.finish_reason, choice.stop_reason = (delta.finish_reason,
                                                                delta.stop_reason)
            first = outputs[0]
            prefix, prefix_ids, prefix_logprobs = self.echo_prefix(generation,
                                                                   first.prompt_logprobs)
            for k, choice in enumerate(assembled):
                num_generated += len(choice.token_ids)
                choices.append(CompletionChoice(
                    index=gi * self.n + k, text=prefix + choice.text,
                    logprobs=self.logprobs_of(prefix_ids + choice.token_ids,
                                              prefix_logprobs + choice.logprobs, 0),
                    finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                    prompt_logprobs=(first.prompt_logprobs
                                     if self.body.prompt_logprobs is not None else None)))
        num_prompt = sum(len(g.prompt.prompt_token_ids) for g in generations)
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices,
                                  usage=UsageInfo.of(num_prompt, num_generated),
                                  kv_transfer_params=results[0][-1].kv_transfer_params)

    async def stream(self, generations: list[Generation]
                     ) -> AsyncIterator[CompletionStreamResponse]:
        created = CompletionStreamResponse(model=self.model, choices=[]).created
        sent_chars: dict[int, int] = {}
        prompt_logprobs: dict[int, list] = {}  # per generation: arrives with its first delta
        num_prompt = sum(len(g.prompt.prompt_token_ids) for g in generations)
        num_generated = 0
        async for gi, output in merged_outputs(generations):
            if output.prompt_logprobs is not None:
                prompt_logprobs[gi] = output.prompt_logprobs
            for delta in map(self.generated, output.outputs):
                index = gi * self.n + delta.index
                text, ids = delta.text, delta.token_ids
                logprobs = delta.logprobs or [None] * len(ids)
                if index not in sent_chars:
                    prefix, prefix_ids, prefix_logprobs = self.echo_prefix(
                        generations[gi], prompt_logprobs.get(gi))
                    text, ids = prefix + text, prefix_ids + ids
                    logprobs = prefix_logprobs + logprobs
                offset = sent_chars.get(index, 0)
                sent_chars[index] = offset + len(text)
                num_generated += len(delta.token_ids)
                usage = (UsageInfo.of(num_prompt, num_generated)
                         if self.body.continuous_usage_stats else None)
                choice = CompletionChoice(
                    index=index, text=text, logprobs=self.logprobs_of(ids, logprobs, offset),
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                yield CompletionStreamResponse(id=self.request_id, created=created,
                                               model=self.model, choices=[choice], usage=usage)
        if self.body.include_usage:
            yield CompletionStreamResponse(
                id=self.request_id, created=created, model=self.model, choices=[],
                usage=UsageInfo.of(num_prompt, num_generated))
