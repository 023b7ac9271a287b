"""`Request`: the scheduler's view of one sequence being generated."""

from __future__ import annotations

import enum
import time
from typing import Any

from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # blocks allocated, a KV connector loading them: not scheduled
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Token ids, progress and status of one sequence.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the tokens still to compute
    are `all_token_ids[num_computed_tokens:]` (a whole prompt at first, then one sampled token).

    A pooling request (`pooling_params`, the pooling runner's) is its prompt only: it samples
    nothing (`max_tokens` 0, so a step in flight never leaves it a token to schedule) and
    finishes once the runner has pooled its prompt (`Scheduler.update_from_output`).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
        grammar: Any = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps in flight, not yet received (async scheduling only): the
        # request's next token is already scheduled though its id is known to the runner only.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling; -1: not yet
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks, in order
        # The KV cache manager's (`KVCacheCoordinator.set_bounds`): the tokens its blocks have
        # room for, and the most of them with nothing to register either (a decode within
        # needs no call)
        self.num_slot_tokens = self.num_covered_tokens = 0
        self.pooling_params = pooling_params
        self.max_tokens = (0 if pooling_params is not None
                           else sampling_params.max_tokens or 1 << 62)
        # Whether a prefix-cache hit may skip its first tokens: not for prompt logprobs, nor
        # for pooling that reads every token's hidden state (MEAN, CLS)
        self.takes_prefix_hits = sampling_params.prompt_logprobs is None and not (
            pooling_params is not None and pooling_params.needs_every_token)
        # The engine's, not the user's: the model's EOS ids (from its generation config) and
        # the request's constraint compiled for its tokenizer (opaque here: the runner's)
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar = grammar
        # The ids that end it: its stop_token_ids, and EOS unless ignore_eos
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids).union(
            () if sampling_params.ignore_eos else self.eos_token_ids)
        # A KV connector's side: tokens it is loading (WAITING_FOR_REMOTE_KVS) or loaded, and
        # whether a load failed (the connector is then not asked again).
        self.num_external_computed_tokens = 0
        self.kv_load_failed = False
        # Speculative decoding: tokens proposed to follow all_token_ids, verified by the next
        # step that schedules them (core/speculation.py); [] while there are none
        self.spec_token_ids: list[int] = []
        # its drafts' acceptance, estimated (core/speculation.py); None: none verified yet
        self.spec_acceptance: float | None = None

    @property
    def kv_transfer_params(self) -> dict | None:
        return self.sampling_params.kv_transfer_params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> bool:
        """Set a finished status when `token_id`, just appended, ends the request; return
        whether it did. EOS and stop tokens count only from `min_tokens` on."""
        num_output = len(self.output_token_ids)
        if num_output >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if token_id not in self.stop_token_ids or (
                num_output < self.sampling_params.min_tokens and self.grammar is None):
            return False  # (a constrained request samples a stop token before min_tokens
            # only when its grammar has ended: nothing else may follow, and it ends there)
        self.status = RequestStatus.FINISHED_STOPPED
        if self.sampling_params.ignore_eos or token_id not in self.eos_token_ids:
            self.stop_reason = token_id  # a stop token, not EOS
        return True

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower `priority` first, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
