"""`SamplingMetadata`: one step's sampling parameters as tensors, row i = the i-th sampling request.

Built once per step from the runner's `CachedRequestState`s, on the host, with one small copy per
tensor. Every optional feature is `None` when no row of the batch uses it, so the common batches
(all greedy, or plain temperature) build and sample with almost no work. What depends on the rows'
`SamplingParams` alone (`ParamsPart`) is kept by a `SamplingParamsCache` while the steps sample
the same requests in the same order (most decode steps); only what follows the tokens (penalties'
token lists, min_tokens masks, seeded rows' generator seeds) is built again. This module only
gathers parameters; `sampler.py` applies them. Token ids at or above `vocab_size` are dropped
silently here (validating them is the engine's job).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aserve.sampling_params import SamplingType

if TYPE_CHECKING:
    from aserve.runner.request_state import CachedRequestState
    from aserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def seeded_generator_seed(seed: int, position: int) -> int:
    """The generator seed for a request's draw at output position `position`.

    Depends on (seed, position) only — never on the batch — so a seeded request samples the same
    tokens alone, in any batch, and after preemption. Mixed with splitmix64 so that nearby pairs
    give unrelated streams."""
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64) & _MASK63


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [N] int64; vocab_size = off
    max_top_k: int | None  # the largest top_k of a row that has one (known on the host)
    top_p: torch.Tensor | None  # [N] float32; 1 = off
    min_p: torch.Tensor | None  # [N] float32; 0 = off
    presence_penalties: torch.Tensor | None  # [N] float32; 0 = off
    frequency_penalties: torch.Tensor | None  # [N] float32; 0 = off
    repetition_penalties: torch.Tensor | None  # [N] float32; 1 = off
    # Padded with vocab_size. Output tokens when presence/frequency is used; prompt + output
    # tokens when repetition is used.
    output_token_ids: torch.Tensor | None  # [N, max_num_output_tokens] int64
    all_token_ids: torch.Tensor | None  # [N, max_num_tokens] int64
    # Sparse (row, token id, bias) triples; (row, token id) pairs to set to -inf.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # 3 x [B]
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # 2 x [M]
    # Random rows with a seed, and each one's generator seed for this step.
    seeded_rows: list[int]
    seeded_generator_seeds: list[int]
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # Noise for unseeded random rows; None = the sampler's own generator (or the global RNG).
    generator: torch.Generator | None = None

    @classmethod
    def build(cls, states: list[CachedRequestState], vocab_size: int,
              device: torch.device | str,
              generator: torch.Generator | None = None,
              pending: list[list[int]] | None = None,
              cache: SamplingParamsCache | None = None) -> SamplingMetadata:
        """`pending[i]`: tokens row i counts as output after its state's (a speculating
        request's drafts before the row's position), for its penalties. `cache`: where the
        parameter tensors of the last batch are kept (`SamplingParamsCache`)."""
        device = torch.device(device)
        params = list(map(operator.attrgetter("sampling_params"), states))  # (no bytecode a row)
        part = (ParamsPart.build(params, vocab_size, device) if cache is None
                else cache.get(params, vocab_size, device))
        return cls(
            temperature=part.temperature,
            all_greedy=part.all_greedy,
            all_random=part.all_random,
            top_k=part.top_k,
            max_top_k=part.max_top_k,
            top_p=part.top_p,
            min_p=part.min_p,
            presence_penalties=part.presence_penalties,
            frequency_penalties=part.frequency_penalties,
            repetition_penalties=part.repetition_penalties,
            output_token_ids=None if not part.uses_output_tokens else _padded(
                _with_pending([s.output_token_ids for s in states], pending), vocab_size,
                device),
            all_token_ids=None if part.repetition_penalties is None else _padded(
                _with_pending([s.all_token_ids for s in states], pending), vocab_size, device),
            logit_bias=part.logit_bias,
            min_tokens_mask=_min_tokens_mask(states, part.min_tokens_rows, vocab_size, device),
            seeded_rows=part.seeded_rows,
            seeded_generator_seeds=[
                seeded_generator_seed(params[i].seed, len(states[i].output_token_ids))
                for i in part.seeded_rows],
            max_num_logprobs=part.max_num_logprobs,
            generator=generator,
        )


@dataclass
class ParamsPart:
    """What a batch's `SamplingMetadata` takes from its rows' `SamplingParams` alone."""

    params: list[SamplingParams]
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    max_top_k: int | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    seeded_rows: list[int]
    min_tokens_rows: list[int]  # rows with a min_tokens (their masks follow their tokens)
    max_num_logprobs: int | None

    @property
    def uses_output_tokens(self) -> bool:
        return self.presence_penalties is not None or self.frequency_penalties is not None

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int,
              device: torch.device) -> ParamsPart:
        types = [p.sampling_type for p in params]
        num_greedy = types.count(SamplingType.GREEDY)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            params=params,
            temperature=_to_device([p.temperature for p in params], torch.float32, device),
            all_greedy=num_greedy == len(params),
            all_random=num_greedy == 0,
            top_k=_optional(top_k, vocab_size, device, torch.int64),
            max_top_k=max((k for k in top_k if k < vocab_size), default=None),
            top_p=_optional([p.top_p for p in params], 1.0, device),
            min_p=_optional([p.min_p for p in params], 0.0, device),
            presence_penalties=_optional([p.presence_penalty for p in params], 0.0, device),
            frequency_penalties=_optional([p.frequency_penalty for p in params], 0.0, device),
            repetition_penalties=_optional([p.repetition_penalty for p in params], 1.0, device),
            logit_bias=_logit_bias(params, vocab_size, device),
            seeded_rows=[i for i, t in enumerate(types) if t == SamplingType.RANDOM_SEEDED],
            min_tokens_rows=[i for i, p in enumerate(params) if p.min_tokens > 0],
            max_num_logprobs=max(logprobs) if logprobs else None,
        )


class SamplingParamsCache:
    """The last batch's `ParamsPart`, given again while a batch has the very same
    `SamplingParams` objects in the same order (it keeps them alive, so an identity is never
    another request's). One per runner (one device). Its tensors are read, never written, by
    the sampler."""

    def __init__(self) -> None:
        self._last: ParamsPart | None = None

    def get(self, params: list[SamplingParams], vocab_size: int,
            device: torch.device) -> ParamsPart:
        last = self._last
        if (last is None or len(last.params) != len(params)
                or not all(map(operator.is_, last.params, params))):
            last = self._last = ParamsPart.build(params, vocab_size, device)
        return last


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _optional(values: list, neutral: float, device: torch.device,
              dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return _to_device(values, dtype, device)


def _padded(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    ids = _to_device([r + [pad_id] * (width - len(r)) for r in rows], torch.int64, device)
    return ids.clamp_(0, pad_id)  # [N, width]; out-of-vocab ids become padding


def _logit_bias(params: list[SamplingParams], vocab_size: int,
                device: torch.device) -> tuple[torch.Tensor, ...] | None:
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if 0 <= token_id < vocab_size:
                rows.append(i)
                ids.append(token_id)
                values.append(bias)
    if not rows:
        return None
    return (_to_device(rows, torch.int64, device), _to_device(ids, torch.int64, device),
            _to_device(values, torch.float32, device))


def _with_pending(token_ids: list[list[int]], pending: list[list[int]] | None
                  ) -> list[list[int]]:
    if pending is None:
        return token_ids
    return [ids + extra if extra else ids for ids, extra in zip(token_ids, pending, strict=True)]


def _min_tokens_mask(states: list[CachedRequestState], candidates: list[int], vocab_size: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, stop ids) to mask: the stop tokens of `candidates` rows still under min_tokens."""
    rows, ids = [], []
    for i in candidates:
        state = states[i]
        if state.is_below_min_tokens and state.grammar is None:
            # (a constrained row's token bitmask holds its stop tokens back instead)
            stop_ids = [t for t in state.stop_token_ids if 0 <= t < vocab_size]
            rows.extend([i] * len(stop_ids))
            ids.extend(stop_ids)
    if not rows:
        return None
    return _to_device(rows, torch.int64, device), _to_device(ids, torch.int64, device)
