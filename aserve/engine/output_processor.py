"""`OutputProcessor`: engine-core outputs (token ids) → `RequestOutput`s (text, logprobs).

It runs on the frontend side: incremental detokenization, stop strings (a match finishes the
request here and asks the engine to abort it), logprobs with decoded tokens, and the fan-in of
the `n` child requests of one user request.

A parent is either final-only (the offline `LLM`: one `RequestOutput` when every completion has
finished, text and tokens whole) or streaming (`stream=True`: a `RequestOutput` per update of a
completion, carrying only what is new since the last one — the delta text, token ids and
logprobs — and the prompt logprobs once, in the first).

A pooling request (the pooling runner's) has no text: its one, finished output carries its
vector (`PoolingRequestOutput`), final-only or streamed alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aserve.core.outputs import EngineCoreOutput, LogprobsLists, StepOutputs
from aserve.engine.detokenizer import IncrementalDetokenizer
from aserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
)
from aserve.engine.tokenizer import Tokenizer
from aserve.sampling_params import SamplingParams


@dataclass
class ParentRequest:
    """One user request: its prompt and the `n` completions being generated for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionOutput | None]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    stream: bool = False
    prompt_logprobs_sent: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's, when finished
    num_unfinished: int = field(init=False)  # completions still generating

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.completions)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


@dataclass
class ChildState:
    """One completion while it generates; its `CompletionOutput` is made when it finishes (a
    streaming parent's deltas are made from this state each update)."""

    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0
    prompt_logprobs: PromptLogprobs = field(default_factory=list)  # until the prompt's whole
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=self.token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class PoolingRequest:
    """One pooling request waiting for its vector (its engine request has its id)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, ChildState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.pooling: dict[str, PoolingRequest] = {}

    @property
    def engine_request_ids(self) -> list[str]:
        """Every engine request in flight: the children of generations, pooling requests."""
        return [*self.children, *self.pooling]

    def add_request(self, parent: ParentRequest | PoolingRequest, child_ids: list[str]) -> None:
        if isinstance(parent, PoolingRequest):  # (its one engine request has its id)
            self.pooling[parent.request_id] = parent
            return
        self.parents[parent.request_id] = parent
        params = parent.params
        for index, child_id in enumerate(child_ids):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, parent.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                defer=not parent.stream)  # its text is read only once it has finished
            self.children[child_id] = ChildState(
                parent, index, detokenizer, logprobs=[] if params.logprobs is not None else None)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or bool(self.pooling)

    def process_outputs(self, step: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Return the `RequestOutput`s to hand out (streaming parents: one per update; others:
        one when finished), and the child ids to abort in the engine (their stop string matched
        here)."""
        ready: list[RequestOutput] = []
        to_abort: list[str] = []
        children = self.children
        for output in step.outputs:
            self._process(output, ready, to_abort)
        # The step's plain tokens (one each, nothing else to tell): a child whose text is read
        # only when it finishes (an offline `generate`'s) keeps the id and nothing more.
        for req_id, token_id in zip(step.req_ids, step.token_ids, strict=True):
            child = children.get(req_id)
            if child is None:
                continue  # forgotten: its client went away
            detokenizer = child.detokenizer
            if detokenizer.defer:
                child.token_ids.append(token_id)
                detokenizer.ids.append(token_id)
            else:
                self._process(EngineCoreOutput(req_id, [token_id]), ready, to_abort)
        return ready, to_abort

    def _process(self, output: EngineCoreOutput, ready: list[RequestOutput],
                 to_abort: list[str]) -> None:
        child = self.children.get(output.req_id)
        if child is None:  # a pooling request's (one, finished), or a forgotten one's
            pooled = self._pooled(output)
            if pooled is not None:
                ready.append(pooled)
            return
        stop_str = self._process_one(child, output)
        if stop_str is not None:
            to_abort.append(output.req_id)
        parent = child.parent
        if child.finish_reason is not None:
            del self.children[output.req_id]
            parent.completions[child.index] = child.completion()
            parent.num_unfinished -= 1
            if parent.finished:
                del self.parents[parent.request_id]
                if not parent.stream:
                    ready.append(self._request_output(parent))
        if parent.stream:
            delta = self._delta_output(child)
            if delta is not None:
                ready.append(delta)

    def _pooled(self, output: EngineCoreOutput) -> PoolingRequestOutput | None:
        request = self.pooling.pop(output.req_id, None)
        if request is None:
            return None
        vector = output.pooling_output
        return PoolingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                    None if vector is None else PoolingOutput(vector),
                                    num_cached_tokens=output.num_cached_tokens)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a parent (its client went away); return its unfinished child ids."""
        if self.pooling.pop(request_id, None) is not None:
            return [request_id]
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        child_ids = [cid for cid, c in self.children.items() if c.parent is parent]
        for child_id in child_ids:
            del self.children[child_id]
        return child_ids

    def _process_one(self, child: ChildState, output: EngineCoreOutput) -> str | None:
        parent = child.parent
        if output.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
            self._add_prompt_logprobs(child, output.new_prompt_logprobs)
        parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
        if output.kv_transfer_params is not None:
            parent.kv_transfer_params = output.kv_transfer_params
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        new_ids = output.new_token_ids
        if (finish_reason == "stop" and not isinstance(stop_reason, str)
                and not parent.params.include_stop_str_in_output):
            new_ids = new_ids[:-1]  # the EOS / stop token itself is not part of the text
        stop_str, kept = self._update_text(child, new_ids, finish_reason is not None)
        if stop_str is not None:
            finish_reason, stop_reason = "stop", stop_str
            kept = min(kept, len(output.new_token_ids))
        else:
            kept = len(output.new_token_ids)
        child.token_ids.extend(output.new_token_ids[:kept])
        if output.new_logprobs is not None and child.logprobs is not None:
            for entry in self._logprob_dicts(output.new_logprobs)[:kept]:
                child.logprobs.append(entry)
                child.cumulative_logprob += entry[next(iter(entry))].logprob
        child.finish_reason, child.stop_reason = finish_reason, stop_reason
        return stop_str

    @staticmethod
    def _update_text(child: ChildState, new_ids: list[int], finished: bool
                     ) -> tuple[str | None, int]:
        """Feed the detokenizer; (the stop string that appeared, the tokens up to and with the
        one that completed it). Several tokens of one step (accepted drafts, under speculative
        decoding) go one at a time where stop strings are watched for, so that the output ends
        at the token a step-by-step decode would have ended it at."""
        detokenizer = child.detokenizer
        if len(new_ids) <= 1 or not detokenizer.stop:
            return detokenizer.update(new_ids, finished), len(new_ids)
        for i, token_id in enumerate(new_ids):
            stop_str = detokenizer.update([token_id], finished and i == len(new_ids) - 1)
            if stop_str is not None:
                return stop_str, i + 1
        return None, len(new_ids)

    def _add_prompt_logprobs(self, child: ChildState, lists: LogprobsLists) -> None:
        """Each of `n` children computes the prompt's logprobs (in chunks); the parent takes
        the first child's whole set, so they are complete before any child's first token and
        never counted n times."""
        parent = child.parent
        if len(parent.prompt_logprobs) == len(parent.prompt_token_ids):
            return  # complete already (from this child or a sibling)
        child.prompt_logprobs.extend(self._logprob_dicts(lists))
        if 1 + len(child.prompt_logprobs) == len(parent.prompt_token_ids):
            parent.prompt_logprobs.extend(child.prompt_logprobs)
            child.prompt_logprobs = []

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        entries = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks,
                                             strict=True):
            entry = {token_ids[0]: Logprob(logprobs[0], rank, self._decode_one(token_ids[0]))}
            for i, (token_id, logprob) in enumerate(zip(token_ids[1:], logprobs[1:]), start=1):
                entry.setdefault(token_id, Logprob(logprob, i, self._decode_one(token_id)))
            entries.append(entry)
        return entries

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _delta_output(self, child: ChildState) -> RequestOutput | None:
        """What is new in one completion of a streaming parent, or None if nothing is."""
        parent = child.parent
        finished = child.finish_reason is not None
        text = child.detokenizer.get_next_output_text(finished, delta=True)
        start = child.num_sent_tokens
        new_ids = child.token_ids[start:]
        if not text and not new_ids and not finished:
            return None
        child.num_sent_tokens = len(child.token_ids)
        prompt_logprobs = None
        if not parent.prompt_logprobs_sent:
            prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
        logprobs = child.logprobs
        delta = CompletionOutput(
            index=child.index, text=text, token_ids=new_ids,
            cumulative_logprob=child.cumulative_logprob if logprobs is not None else None,
            logprobs=logprobs[start:] if logprobs is not None else None,
            finish_reason=child.finish_reason, stop_reason=child.stop_reason)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             prompt_logprobs, [delta], parent.finished, parent.num_cached_tokens,
                             kv_transfer_params=parent.kv_transfer_params)

    def _request_output(self, parent: ParentRequest) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=list(parent.completions),
            finished=True,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params,
        )
