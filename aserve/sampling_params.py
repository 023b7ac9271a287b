"""`SamplingParams`: how one request turns logits into tokens and when it stops.

Shaped like vLLM's so that user code switches by changing an import. Validation happens once, at
construction, and names the offending field; nothing invalid reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024  # a request's `cache_salt` (vLLM's prefix-cache isolation)
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's `StructuredOutputsParams`): a JSON schema
    (`json`: a dict or its JSON text), any JSON object (`json_object`), a regex, one of
    `choice`, an EBNF `grammar`, or a `structural_tag`. Exactly one is set."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    # The constraint starts once the output has this text (a reasoning model's "</think>");
    # set by the server's reasoning parser, not by users
    start_after: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}.")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEEDED = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0 via the API) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Disaggregated prefill: what the KV connector reads of this request (vLLM's
    # `kv_transfer_params`, e.g. {"do_remote_decode": true}); checked against the engine's
    # connector. vLLM carries it in `extra_args["kv_transfer_params"]`, accepted here too.
    kv_transfer_params: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.extra_args and "kv_transfer_params" in self.extra_args:
            if self.kv_transfer_params is not None:
                raise ValueError("kv_transfer_params is given twice: as a field and in "
                                 "extra_args; give one.")
            self.kv_transfer_params = self.extra_args["kv_transfer_params"]
            self.extra_args = {k: v for k, v in self.extra_args.items()
                               if k != "kv_transfer_params"}  # (moved: `replace` copies it)
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError("kv_transfer_params must be a dict (a JSON object), got "
                             f"{type(self.kv_transfer_params).__name__}.")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k == 0:
            self.top_k = -1
        if 0 <= self.temperature < 1e-5:  # greedy: the filters below are meaningless
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, -1, 0.0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be at least 1")
        check(self.temperature >= 0.0, "temperature", "must be non-negative")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
              "must be -1 (disable), or at least 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than zero")
        max_tokens_ok = isinstance(self.max_tokens, int) and self.max_tokens >= 1
        check(self.max_tokens is None or max_tokens_ok, "max_tokens", "must be at least 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
              "must be greater than or equal to 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be less than or equal to max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), name,
                  f"must be in [0, {MAX_LOGPROBS}]")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEEDED

