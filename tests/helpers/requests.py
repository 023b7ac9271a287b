"""`make_request`: a core `Request` for the scheduler, KV cache and hashing tests (no torch)."""

from __future__ import annotations

from collections.abc import Sequence

from aserve.core.request import Request
from aserve.sampling_params import SamplingParams


def make_request(req_id: str = "r", prompt: Sequence[int] = (1, 2, 3), *, arrival: float = 0.0,
                 priority: int = 0, cache_salt: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), **params) -> Request:
    """A request for `prompt` with `SamplingParams(**params)` (max_tokens defaults to 16 there);
    `eos_token_ids` is what the engine gives it from the model's generation config."""
    return Request(req_id, list(prompt), SamplingParams(**params), arrival_time=arrival,
                   priority=priority, cache_salt=cache_salt, eos_token_ids=eos_token_ids)
