"""`Processor`: turns a user's prompt and `SamplingParams` into validated engine requests.

    prompt ─ process_prompt ─► ProcessedPrompt ─┐
    params ─────────────────────────────────────┴─ prepare ─► PreparedRequest ─► make_requests
                       (checked, max_tokens defaulted, the constraint compiled)   ─► Requests

Everything that could make a model step fail is checked here, once, before a request reaches
the engine: empty prompts, token ids outside the vocabulary, the context length (`check_context`,
the one place it is checked), logit-bias ids; a structured-output constraint is compiled here
too (a bad one is a ValueError). What the engine adds — the default `max_tokens`, the model's
EOS ids, the compiled grammar — goes on its copy of the params and on the engine's `Request`,
never on the user's `SamplingParams`.

A pooling request (`PoolingParams`, for a model the pooling runner serves) takes the same
path: its copy gets the model's pooling defaults (`ModelInfo.pooler`), `dimensions` is checked
against the hidden size. Each runner refuses the other's requests here, naming `--runner`.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

from aserve.config import KVTransferConfig, ModelInfo
from aserve.core.request import Request
from aserve.engine.output_processor import ParentRequest, PoolingRequest
from aserve.engine.tokenizer import Tokenizer
from aserve.kv_transfer import check_params
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import (
    MAX_CACHE_SALT_CHARS,
    SamplingParams,
    StructuredOutputsParams,
)
from aserve.structured_output import CompiledGrammar, GrammarCompiler

PromptType = str | Mapping
# What a pooling request's `Request` carries as sampling params: nothing it uses (it samples
# nothing; `Request.max_tokens` is 0 for it)
POOLING_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt tokenized and checked (made by `Processor.process_prompt` only)."""

    prompt: str | None
    prompt_token_ids: list[int]
    # vLLM's `cache_salt`: keys the prompt's first block, so its cached blocks are shared only
    # with prompts of the same salt (one tenant's prefix cache is not another's)
    cache_salt: str | None = None


@dataclass(frozen=True)
class PreparedRequest:
    """One request ready for the engine (made by `Processor.prepare` only): its prompt, a copy
    of the user's params with the engine's defaults applied (`max_tokens`), and the engine's
    own state for it, the constraint compiled for this tokenizer."""

    prompt: ProcessedPrompt
    params: SamplingParams | PoolingParams
    grammar: CompiledGrammar | None = None
    priority: int = 0

    @property
    def num_engine_requests(self) -> int:
        """Sequences it starts: `n` completions, or one pooled prompt."""
        return self.params.n if isinstance(self.params, SamplingParams) else 1


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus `max_tokens`, does not fit the model's context; `param`
    is the request field to blame (None: the prompt's)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Processor:
    def __init__(self, tokenizer: Tokenizer, model_info: ModelInfo,
                 any_whitespace: bool = False,
                 kv_transfer_config: KVTransferConfig | None = None,
                 strict_max_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.kv_transfer_config = kv_transfer_config  # None: kv_transfer_params are refused
        self.any_whitespace = any_whitespace  # False: JSON constraints without free whitespace
        # True (the server, as vLLM's): a prompt plus max_tokens over the context is refused;
        # False (offline, as vLLM's LLM): generation stops at the context instead
        self.strict_max_tokens = strict_max_tokens
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first constraint
        self._grammar_lock = threading.Lock()

    def process_prompt(self, prompt: PromptType,
                       add_special_tokens: bool = True) -> ProcessedPrompt:
        """A string, or vLLM's prompt dicts: {'prompt': str} or {'prompt_token_ids': [...]},
        either with an optional 'cache_salt'."""
        if isinstance(prompt, str):
            return self.check_prompt(ProcessedPrompt(prompt, self.encode(prompt,
                                                                         add_special_tokens)))
        salt = check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, Mapping) else None
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers.")
            return self.check_prompt(ProcessedPrompt(prompt.get("prompt"), list(ids), salt))
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            processed = self.process_prompt(prompt["prompt"], add_special_tokens)
            return replace(processed, cache_salt=salt)
        raise ValueError("A prompt must be a string, {'prompt': str} or "
                         "{'prompt_token_ids': [int, ...]}, got "
                         f"{type(prompt).__name__}.")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text that can fit in the context (see `check_text_length`)."""
        self.check_text_length(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @property
    def max_prompt_chars(self) -> int:
        return self.tokenizer.max_token_chars * self.model_info.max_model_len

    def check_text_length(self, text: str) -> None:
        """Refuse, before it is tokenized, a text longer than the context can hold: one token
        stands for at most `Tokenizer.max_token_chars` characters. (Tokenizing a huge text
        costs seconds and gigabytes, only to be refused then.)"""
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"prompt is {len(text)} characters long, more than this model's maximum "
                f"context length of {self.model_info.max_model_len} tokens can hold (at most "
                f"{self.max_prompt_chars} characters: {self.tokenizer.max_token_chars} a "
                "token). Please reduce the length of the prompt.")

    def check_prompt(self, processed: ProcessedPrompt) -> ProcessedPrompt:
        ids = processed.prompt_token_ids
        if not ids:
            raise ValueError("The prompt is empty: give at least one token.")
        self.check_context(len(ids), None)  # (first: the ids checked below are at most that)
        self.check_token_ids(ids, "prompt_token_ids")
        return processed

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The `max_tokens` a request of this prompt length may have (`max_tokens`, or what
        the context leaves when None); ContextLengthError when the prompt leaves no room, or,
        with `strict_max_tokens`, when prompt + max_tokens is over the context. The one place
        the context length is checked."""
        max_model_len = self.model_info.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + 1} tokens ({num_prompt_tokens} in the prompt, "
                "at least 1 to generate). Please reduce the length of the prompt.")
        room = max_model_len - num_prompt_tokens
        if max_tokens is None:
            return room
        if self.strict_max_tokens and max_tokens > room:
            raise ContextLengthError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.", "max_tokens")
        return max_tokens

    def check_token_ids(self, token_ids, field_name: str) -> None:
        vocab_size = self.model_info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} in {field_name} is out of vocabulary "
                             f"(the model has {vocab_size} tokens).")

    def prepare(self, prompt: ProcessedPrompt, params: SamplingParams | PoolingParams,
                priority: int = 0) -> PreparedRequest:
        """`prompt` and `params` as one request for the engine, its constraint compiled here
        (blocking: the offline `LLM`; the server uses `prepare_async`)."""
        if isinstance(params, PoolingParams):
            return self.prepare_pooling(prompt, params, priority)
        params = self.check_params(params, len(prompt.prompt_token_ids))
        spec = self._grammar_spec(params)
        grammar = (self.grammar_compiler().compile(spec, self._start_after_ids(spec))
                   if spec is not None else None)
        return PreparedRequest(prompt, params, grammar, priority)

    async def prepare_async(self, prompt: ProcessedPrompt,
                            params: SamplingParams | PoolingParams,
                            priority: int, compile_timeout: float) -> PreparedRequest:
        """`prepare` for the event loop: the constraint compiles in the compiler's worker
        processes (no thread of the loop's waits on it), cheap ones first; one still compiling
        after `compile_timeout` seconds is killed and refused (ValueError)."""
        if isinstance(params, PoolingParams):
            return self.prepare_pooling(prompt, params, priority)
        params = self.check_params(params, len(prompt.prompt_token_ids))
        spec = self._grammar_spec(params)
        grammar = None
        if spec is not None:
            compiler = self._grammar_compiler or await asyncio.to_thread(self.grammar_compiler)
            grammar = await compiler.compile_async(spec, self._start_after_ids(spec),
                                                   compile_timeout)
        return PreparedRequest(prompt, params, grammar, priority)

    def prepare_pooling(self, prompt: ProcessedPrompt, params: PoolingParams,
                        priority: int = 0) -> PreparedRequest:
        """A pooling request: a copy of `params` with the model's defaults in (pooling type,
        normalisation), `dimensions` at most the hidden size; ValueError on a model the
        generate runner serves."""
        pooler = self.model_info.pooler
        if pooler is None:
            raise ValueError("This model runs the generate runner: it does not pool "
                             "(embeddings, score, rerank). Start aserve with --runner pooling "
                             "to embed with it.")
        hidden_size = self.model_info.hidden_size
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValueError(f"dimensions must be at most the model's hidden size "
                             f"({hidden_size}), got {params.dimensions}.")
        params = replace(params, pooling_type=params.pooling_type or pooler.pooling_type,
                         normalize=(pooler.normalize if params.normalize is None
                                    else params.normalize))
        return PreparedRequest(prompt, params, None, priority)

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A copy of `params` checked against the model and the context (`check_context`),
        its `max_tokens` filled in when None."""
        if self.model_info.pooler is not None:
            raise ValueError("This model runs the pooling runner: it does not generate "
                             "(completions, chat); it answers /v1/embeddings, /v1/score and "
                             "/rerank. Start aserve with --runner generate to generate.")
        if params.logit_bias:
            self.check_token_ids(params.logit_bias, "logit_bias")
        if params.stop_token_ids:
            self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.top_k > self.model_info.vocab_size:
            raise ValueError(f"top_k must not exceed the vocabulary size "
                             f"({self.model_info.vocab_size}), got {params.top_k}.")
        max_tokens = self.check_context(num_prompt_tokens, params.max_tokens)
        params = replace(params, max_tokens=max_tokens)
        if params.kv_transfer_params is not None:
            self._check_kv_transfer_params(params)
        return params

    def _grammar_spec(self, params: SamplingParams) -> StructuredOutputsParams | None:
        """The constraint to compile for `params`, its JSON compact unless the server allows
        free whitespace."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if not self.any_whitespace and not spec.disable_any_whitespace:
            spec = replace(spec, disable_any_whitespace=True)
        return spec

    def _start_after_ids(self, spec: StructuredOutputsParams) -> list[int] | None:
        return (self.tokenizer.encode(spec.start_after, add_special_tokens=False)
                if spec.start_after else None)

    def _check_kv_transfer_params(self, params: SamplingParams) -> None:
        """Against this engine's KV connector; the engine gets a copy of its own."""
        check_params(params.kv_transfer_params, self.kv_transfer_config)
        if params.n != 1:
            raise ValueError(f"kv_transfer_params works with n=1 only, got n={params.n}.")
        params.kv_transfer_params = copy.deepcopy(params.kv_transfer_params)

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of constraints for this tokenizer (cached compiled grammars and its
        worker processes inside)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer.backend, self.model_info.vocab_size,
                    self.model_info.eos_token_ids)
            return self._grammar_compiler

    def make_requests(self, request_id: str, prepared: PreparedRequest, stream: bool = False
                      ) -> tuple[ParentRequest | PoolingRequest, list[Request]]:
        """The user request, and the engine requests that generate it: one, or `n` children
        (ids `"{i}_{request_id}"`, seeds `seed + i`) that share the prompt's cached blocks; a
        pooling request's one engine request, of its id."""
        prompt, params = prepared.prompt, prepared.params
        if isinstance(params, PoolingParams):
            return (PoolingRequest(request_id, prompt.prompt, prompt.prompt_token_ids),
                    [Request(request_id, prompt.prompt_token_ids, POOLING_SAMPLING_PARAMS,
                             priority=prepared.priority, cache_salt=prompt.cache_salt,
                             pooling_params=params)])
        parent = ParentRequest(request_id, prompt.prompt, prompt.prompt_token_ids, params,
                               completions=[None] * params.n, stream=stream)
        engine_state = dict(priority=prepared.priority, cache_salt=prompt.cache_salt,
                            eos_token_ids=self.model_info.eos_token_ids,
                            grammar=prepared.grammar)
        if params.n == 1:
            return parent, [Request(request_id, prompt.prompt_token_ids, params, **engine_state)]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append(Request(f"{i}_{request_id}", prompt.prompt_token_ids,
                                    replace(params, n=1, seed=seed), **engine_state))
        return parent, children


def check_cache_salt(salt: object) -> str | None:
    """vLLM's rule: absent, or a non-empty string (here also at most 1024 characters)."""
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be a non-empty string of at most "
                         f"{MAX_CACHE_SALT_CHARS} characters.")
    return salt
