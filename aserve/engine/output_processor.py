"""`OutputProcessor`: engine-core outputs (token ids) → `RequestOutput`s (text, logprobs).

It runs on the frontend side: incremental detokenization, stop strings (a match finishes the
request here and asks the engine to abort it), logprobs with decoded tokens, and the fan-in of
the `n` child requests of one user request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aserve.core.outputs import EngineCoreOutput, LogprobsLists
from aserve.engine.detokenizer import IncrementalDetokenizer
from aserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
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

    @property
    def finished(self) -> bool:
        return all(c is not None and c.finished() for c in self.completions)


@dataclass
class ChildState:
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, ChildState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(self, parent: ParentRequest, child_ids: list[str]) -> None:
        self.parents[parent.request_id] = parent
        params = parent.params
        for index, child_id in enumerate(child_ids):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, parent.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            self.children[child_id] = ChildState(
                parent, index, detokenizer, logprobs=[] if params.logprobs is not None else None)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Return the user requests that finished, and the child ids to abort in the engine
        (their stop string matched here)."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        for output in outputs:
            child = self.children.get(output.req_id)
            if child is None:
                continue
            stop_str = self._process_one(child, output)
            if stop_str is not None:
                to_abort.append(output.req_id)
            completion = child.parent.completions[child.index]
            if completion is not None and completion.finished():
                del self.children[output.req_id]
                parent = child.parent
                if parent.finished:
                    del self.parents[parent.request_id]
                    finished.append(self._request_output(parent))
        return finished, to_abort

    def _process_one(self, child: ChildState, output: EngineCoreOutput) -> str | None:
        parent = child.parent
        if output.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(self._logprob_dicts(output.new_prompt_logprobs))
        parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
        child.token_ids.extend(output.new_token_ids)
        if output.new_logprobs is not None and child.logprobs is not None:
            for entry in self._logprob_dicts(output.new_logprobs):
                child.logprobs.append(entry)
                child.cumulative_logprob += entry[next(iter(entry))].logprob
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        new_ids = output.new_token_ids
        if (finish_reason == "stop" and not isinstance(stop_reason, str)
                and not parent.params.include_stop_str_in_output):
            new_ids = new_ids[:-1]  # the EOS / stop token itself is not part of the text
        stop_str = child.detokenizer.update(new_ids, finish_reason is not None)
        if stop_str is not None:
            finish_reason, stop_reason = "stop", stop_str
        parent.completions[child.index] = CompletionOutput(
            index=child.index,
            text=child.detokenizer.output_text,
            token_ids=child.token_ids,
            cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
            logprobs=child.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return stop_str

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

    def _request_output(self, parent: ParentRequest) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=[c for c in parent.completions if c is not None],
            finished=True,
            num_cached_tokens=parent.num_cached_tokens,
        )
