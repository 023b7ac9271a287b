"""`SamplingMetadata`: one step's sampling parameters as tensors, row i = the i-th sampling request.

Built once per step from the runner's `CachedRequestState`s, on the host, with one small copy per
tensor. Every optional feature is `None` when no row of the batch uses it, so the common batches
(all greedy, or plain temperature) build and sample with almost no work. This module only gathers
parameters; `sampler.py` applies them. Token ids at or above `vocab_size` are dropped silently here
(validating them is the engine's job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aserve.sampling_params import SamplingType

if TYPE_CHECKING:
    from aserve.runner.request_state import CachedRequestState

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
              pending: list[list[int]] | None = None) -> SamplingMetadata:
        """`pending[i]`: tokens row i counts as output after its state's (a speculating
        request's drafts before the row's position), for its penalties."""
        device = torch.device(device)
        params = [s.sampling_params for s in states]
        types = [p.sampling_type for p in params]
        num_greedy = types.count(SamplingType.GREEDY)
        seeded_rows = [i for i, t in enumerate(types) if t == SamplingType.RANDOM_SEEDED]
        rep = _optional([p.repetition_penalty for p in params], 1.0, device)
        pres = _optional([p.presence_penalty for p in params], 0.0, device)
        freq = _optional([p.frequency_penalty for p in params], 0.0, device)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=_to_device([p.temperature for p in params], torch.float32, device),
            all_greedy=num_greedy == len(states),
            all_random=num_greedy == 0,
            top_k=_optional(top_k, vocab_size, device, torch.int64),
            max_top_k=max((k for k in top_k if k < vocab_size), default=None),
            top_p=_optional([p.top_p for p in params], 1.0, device),
            min_p=_optional([p.min_p for p in params], 0.0, device),
            presence_penalties=pres,
            frequency_penalties=freq,
            repetition_penalties=rep,
            output_token_ids=None if pres is None and freq is None else _padded(
                _with_pending([s.output_token_ids for s in states], pending), vocab_size,
                device),
            all_token_ids=None if rep is None else _padded(
                _with_pending([s.all_token_ids for s in states], pending), vocab_size, device),
            logit_bias=_logit_bias(states, vocab_size, device),
            min_tokens_mask=_min_tokens_mask(states, vocab_size, device),
            seeded_rows=seeded_rows,
            seeded_generator_seeds=[
                seeded_generator_seed(params[i].seed, len(states[i].output_token_ids))
                for i in seeded_rows],
            max_num_logprobs=max(logprobs) if logprobs else None,
            generator=generator,
        )


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


def _logit_bias(states: list[CachedRequestState], vocab_size: int,
                device: torch.device) -> tuple[torch.Tensor, ...] | None:
    rows, ids, values = [], [], []
    for i, state in enumerate(states):
        for token_id, bias in (state.sampling_params.logit_bias or {}).items():
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


def _min_tokens_mask(states: list[CachedRequestState], vocab_size: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, ids = [], []
    for i, state in enumerate(states):
        if state.is_below_min_tokens and state.grammar is None:
            # (a constrained row's token bitmask holds its stop tokens back instead)
            stop_ids = [t for t in state.stop_token_ids if 0 <= t < vocab_size]
            rows.extend([i] * len(stop_ids))
            ids.extend(stop_ids)
    if not rows:
        return None
    return _to_device(rows, torch.int64, device), _to_device(ids, torch.int64, device)
