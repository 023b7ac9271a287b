"""Messages between the scheduler, the model runner and the frontend.

A schedule is `{request_id: num_scheduled_tokens}`. Requests the runner has not seen (new ones and
ones resumed after preemption) travel whole in `NewRequestData`; requests it already holds travel
as diffs in `CachedRequestData` (new blocks and the new computed count). The runner keeps its own
copy of every running request's token ids and appends the tokens it samples.

Block ids come one list per KV cache group, in group order (`CacheConfig.groups`): the runner
appends `new_block_ids[g]` to its block table of group g. A sliding-window group's list may
hold the null block (id 0) where a prefix hit skipped blocks behind the window; blocks the
scheduler frees later as the window passes are not replaced in the runner's table (those
positions are outside every window, so attention never reads them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from aserve.core.kv_connector import KVConnectorOutput
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per group
    num_computed_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # the engine's: stop_token_ids, and EOS
    grammar: Any = None  # the engine's: the request's constraint, compiled
    pooling_params: PoolingParams | None = None  # a pooling request's (the engine's defaults in)


class CachedRequestData(NamedTuple):  # a tuple: one a running request a step, built fast
    req_id: str
    new_block_ids: tuple[Sequence[int], ...]  # per group: appended to the runner's tables
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # In batch order: cached (running) requests first, then new ones, as the dict iterates.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Of those, the decodes: a request's one token past its prompt (the one it sampled last).
    # The rest are prefill (prompt chunks, recomputation after preemption); for the dashboard.
    num_decode_tokens: int = 0
    # The keys every row's query attends, summed (`step_cost.attention_keys`): the step-cost
    # fit's third term.
    num_attention_keys: int = 0
    # Requests the runner must forget before this step: finished, aborted or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # The KV connector's work for this step (`KVConnectorScheduler.build_connector_meta`);
    # None without a connector.
    kv_connector_metadata: Any = None
    # Speculative decoding: per request given drafts, the drafts, in order. Its tokens this
    # step are its last sampled token and these (they follow it at the next positions).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # With a draft model: per request that samples this step, how many drafts its draft
    # passes should propose after it (the scheduler's policy; none listed: no passes).
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Whether the draft model runs on this step's tokens (its K/V): while drafting pays
    draft_model_runs: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def num_computed_before(self, req_id: str) -> int:
        """How many tokens `req_id` had computed when this step was scheduled."""
        for data in self.scheduled_cached_reqs:
            if data.req_id == req_id:
                return data.num_computed_tokens
        for new in self.scheduled_new_reqs:
            if new.req_id == req_id:
                return new.num_computed_tokens
        raise KeyError(req_id)


@dataclass
class LogprobsLists:
    """Top-k logprobs of some rows. Row i: `token_ids[i][0]` is the chosen (sampled or prompt)
    token and `ranks[i]` its rank (1 = most likely); the rest are the top-k in order."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One entry per scheduled request, in `req_ids` order: the sampled token id, or None when the
    # step only computed part of the prompt (nothing to sample yet).
    sampled_token_ids: list[int | None]
    # Per request: a one-row LogprobsLists for its sampled token, when it asked for logprobs.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Per request: rows for the prompt tokens this step covered, when it asked for them.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Wall time of the model itself (forward + logits), to tell engine overhead apart.
    forward_seconds: float = 0.0
    # Transfers the KV connector finished this step, on every rank (None: no connector).
    kv_connector_output: KVConnectorOutput | None = None
    # Speculative decoding: per request that had drafts, how many of them the target accepted
    # (its tokens this step: those drafts, then its entry in sampled_token_ids).
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)
    # Speculative decoding with a draft model: per request that sampled, the drafts proposed
    # to follow its new token (the scheduler keeps what the next step can carry).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # the draft model's passes after sampling, and how many
    draft_passes: int = 0
    # The pooling runner: per request whose prompt this step completed, its pooled vector (a
    # float32 numpy array, `runner/pooler.py`); its entry in sampled_token_ids is None
    pooler_output: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # The KV connector's `request_finished` answer, on the finished output only.
    kv_transfer_params: dict[str, Any] | None = None
    # A pooling request's vector (float32 numpy array), on its one, finished output
    pooling_output: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepOutputs:
    """What a step gave its requests (`Scheduler.update_from_output`): `outputs`, one
    `EngineCoreOutput` per request with anything to tell besides one token, and the rest in two
    columns — request `req_ids[i]` got `token_ids[i]`, its one new token, and nothing else (not
    its first token, not finished, no logprobs, no drafts): most requests of most steps, for
    which an object each would cost more than the token. Iterating gives every output as an
    `EngineCoreOutput` (those of the columns made then); the `OutputProcessor` reads the
    columns as they are."""

    __slots__ = ("outputs", "req_ids", "token_ids")

    def __init__(self, outputs: list[EngineCoreOutput] | None = None) -> None:
        self.outputs: list[EngineCoreOutput] = [] if outputs is None else outputs
        self.req_ids: list[str] = []
        self.token_ids: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.outputs) or bool(self.req_ids)

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        yield from self.outputs
        for req_id, token_id in zip(self.req_ids, self.token_ids, strict=True):
            yield EngineCoreOutput(req_id, [token_id])


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0  # since start
    # The KV connector, since start: prompt tokens asked of it and loaded from it, requests
    # recomputed after a failed load, and what the workers moved (bytes, seconds).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_kv_load_failures: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    num_waiting_for_remote_kvs: int = 0  # now: requests whose KV is being loaded
    num_held_blocks: int = 0  # now: blocks of finished requests a KV connector still uses
    # Speculative decoding, since start (vLLM's names): steps of a request that verified
    # drafts, the drafts verified and accepted, and the accepted ones by draft position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
