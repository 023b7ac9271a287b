"""`Processor`: turns a user's prompt and `SamplingParams` into validated engine requests.

Everything that could make a model step fail is checked here, before a request reaches the
engine: empty or over-long prompts, token ids outside the vocabulary, logit-bias ids; a
structured-output constraint is compiled here too (a bad one is a ValueError).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

from aserve.config import KVTransferConfig, ModelInfo
from aserve.core.request import Request
from aserve.engine.output_processor import ParentRequest
from aserve.engine.tokenizer import Tokenizer
from aserve.kv_transfer import check_params
from aserve.sampling_params import SamplingParams
from aserve.structured_output import GrammarCompiler

PromptType = str | Mapping


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class Processor:
    def __init__(self, tokenizer: Tokenizer, model_info: ModelInfo,
                 any_whitespace: bool = False,
                 kv_transfer_config: KVTransferConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.kv_transfer_config = kv_transfer_config  # None: kv_transfer_params are refused
        self.any_whitespace = any_whitespace  # False: JSON constraints without free whitespace
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first constraint
        self._grammar_lock = threading.Lock()

    def process_prompt(self, prompt: PromptType,
                       add_special_tokens: bool = True) -> ProcessedPrompt:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            return self.check_prompt(ProcessedPrompt(prompt, ids))
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers.")
            return self.check_prompt(ProcessedPrompt(prompt.get("prompt"), list(ids)))
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            return self.process_prompt(prompt["prompt"], add_special_tokens)
        raise ValueError("A prompt must be a string, {'prompt': str} or "
                         "{'prompt_token_ids': [int, ...]}, got "
                         f"{type(prompt).__name__}.")

    def check_prompt(self, processed: ProcessedPrompt) -> ProcessedPrompt:
        ids = processed.prompt_token_ids
        if not ids:
            raise ValueError("The prompt is empty: give at least one token.")
        self.check_token_ids(ids, "prompt_token_ids")
        max_model_len = self.model_info.max_model_len
        if len(ids) >= max_model_len:
            raise ValueError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {len(ids) + 1} tokens ({len(ids)} in the prompt, at least 1 to "
                "generate). Please reduce the length of the prompt.")
        return processed

    def check_token_ids(self, token_ids, field_name: str) -> None:
        vocab_size = self.model_info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} in {field_name} is out of vocabulary "
                             f"(the model has {vocab_size} tokens).")

    def process_params(self, params: SamplingParams) -> SamplingParams:
        """A copy of `params` checked against the model and given its EOS token ids."""
        if params.logit_bias:
            self.check_token_ids(params.logit_bias, "logit_bias")
        if params.stop_token_ids:
            self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.top_k > self.model_info.vocab_size:
            raise ValueError(f"top_k must not exceed the vocabulary size "
                             f"({self.model_info.vocab_size}), got {params.top_k}.")
        params = copy.copy(params)
        params.eos_token_ids = self.model_info.eos_token_ids
        if params.kv_transfer_params is not None:
            self._check_kv_transfer_params(params)
        spec = params.structured_outputs
        if spec is not None and params.compiled_grammar is None:
            if not self.any_whitespace and not spec.disable_any_whitespace:
                spec = replace(spec, disable_any_whitespace=True)
            start_after = (self.tokenizer.encode(spec.start_after, add_special_tokens=False)
                           if spec.start_after else None)
            params.compiled_grammar = self.grammar_compiler().compile(spec, start_after)
        return params

    def _check_kv_transfer_params(self, params: SamplingParams) -> None:
        """Against this engine's KV connector; the engine gets a copy of its own."""
        check_params(params.kv_transfer_params, self.kv_transfer_config)
        if params.n != 1:
            raise ValueError(f"kv_transfer_params works with n=1 only, got n={params.n}.")
        params.kv_transfer_params = copy.deepcopy(params.kv_transfer_params)

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of constraints for this tokenizer (cached compiled grammars inside)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer.backend, self.model_info.vocab_size,
                    self.model_info.eos_token_ids)
            return self._grammar_compiler

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      priority: int = 0, stream: bool = False
                      ) -> tuple[ParentRequest, list[Request]]:
        """The user request, and the engine requests that generate it: one, or `n` children
        (ids `"{i}_{request_id}"`, seeds `seed + i`) that share the prompt's cached blocks."""
        parent = ParentRequest(request_id, prompt.prompt, prompt.prompt_token_ids, params,
                               completions=[None] * params.n, stream=stream)
        if params.n == 1:
            return parent, [Request(request_id, prompt.prompt_token_ids, params,
                                    priority=priority)]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append(Request(f"{i}_{request_id}", prompt.prompt_token_ids,
                                    replace(params, n=1, seed=seed), priority=priority))
        return parent, children
