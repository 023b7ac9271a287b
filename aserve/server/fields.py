"""The fields of the OpenAI request models (`protocol.py`): the limits that bound what one
request may ask of the server, the strict int and float types with their bounds (a whole
float such as `5.0` or `1e3` is the int it writes), and the shape checks that give `prompt`
and `stop` clearer messages than pydantic's own. Each violation is a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from aserve.sampling_params import MAX_CACHE_SALT_CHARS, MAX_LOGPROBS

# Limits on hostile or careless requests; each violation is a 400 naming the field.
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_TOTAL_CHOICES = 1024  # n × prompts: sequences one request may start
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_TOKEN_ID_DIGITS = 19  # a logit_bias key; anything longer is out of vocabulary anyway
MAX_CHAT_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024  # text parts in one chat message
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


def _is_whole_float(value: Any) -> bool:
    return type(value) is float and value.is_integer()  # False for inf and nan


def _whole_number_to_int(value: Any) -> Any:
    """`5.0` → 5: JSON Schema's integers include whole numbers written with a fraction or an
    exponent (`1e3`). Anything else is left for strict validation to judge: `5.5`, `true` and
    `"5"` are still refused. Bounds apply to the int, so `1e20` is out of an Int64's range."""
    return int(value) if _is_whole_float(value) else value


# Every int field of a request ends its `Annotated` with `WholeNumber`: last, so that it runs
# first and the bounds before it stay on the int schema (`"minimum"` in /openapi.json; put
# first, pydantic would write its own `"ge"` there instead).
WholeNumber = BeforeValidator(_whole_number_to_int)
PositiveInt = Annotated[int, Field(ge=1), WholeNumber]
NonNegativeInt = Annotated[int, Field(ge=0), WholeNumber]
TokenId = Annotated[int, Field(ge=0), WholeNumber]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), WholeNumber]
Temperature = Annotated[float, Field(ge=0.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WholeNumber]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
# Empty stop strings are refused by `SamplingParams`; the schema says so too.
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS, json_schema_extra={"minLength": 1})]
StopInput = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptInput = (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
               | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])


def _all_of_type(values: list, kind: type) -> bool:
    """Whether every item is exactly a `kind` (so no bools for int); C-speed on long lists."""
    return set(map(type, values)) <= {kind}


def _is_token_ids(value: Any) -> bool:
    """Non-negative ints (or whole floats, which `TokenId` makes ints), before validation."""
    if not isinstance(value, list):
        return False
    ints = _all_of_type(value, int) or all(type(v) is int or _is_whole_float(v) for v in value)
    return ints and min(value, default=0) >= 0


def _is_single_prompt(prompt: Any) -> bool:
    """For a prompt already validated: one text or one token-id list (not a batch)."""
    return isinstance(prompt, str) or isinstance(prompt[0], int)


def _check_stop(value: Any) -> None:
    """`stop`'s shape and size (before pydantic's own checks, for clearer messages)."""
    stops = [value] if isinstance(value, str) else value
    if isinstance(stops, list) and len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    if not (isinstance(stops, list) and _all_of_type(stops, str)):
        raise ValueError("stop must be a string or a list of strings.")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters long, got "
                         f"one of {longest}.")


def _check_prompt_shape(value: Any) -> None:
    if isinstance(value, str) or (_is_token_ids(value) and value):
        return
    if isinstance(value, list) and not value:
        raise ValueError("prompt must not be empty.")
    if isinstance(value, list) and len(value) > MAX_PROMPTS:
        raise ValueError(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(value)}.")
    ok = isinstance(value, list) and (
        _all_of_type(value, str) or all(_is_token_ids(p) and p for p in value))
    if not ok:
        raise ValueError("prompt must be a string, a list of strings, a list of non-negative "
                         "token ids or a list of non-empty token-id lists.")
