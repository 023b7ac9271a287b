"""`LLM`: the offline API, shaped like vLLM's (`from aserve import LLM, SamplingParams`).

It drives the same `EngineCore` the server runs, synchronously: add every request, step until
all are finished, return outputs in input order. A model the pooling runner serves
(`runner="pooling"`, or auto for an embedding model) embeds (`embed`, `encode`) and scores
(`score`) instead of generating.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from aserve.assets import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from aserve.core.outputs import SchedulerStats
from aserve.engine.arg_utils import EngineArgs
from aserve.engine.core import KV_IDLE_POLL_S, EngineCore
from aserve.engine.output_processor import OutputProcessor
from aserve.engine.outputs import (
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from aserve.engine.processor import PreparedRequest, Processor, PromptType
from aserve.engine.scoring import cosine, pair_indices
from aserve.engine.tokenizer import Tokenizer
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams


class LLM:
    """Load a model and generate offline.

    With no `model`, it loads the built-in demo model (`aserve.assets.DEMO_MODEL_DIR`, served as
    "aserve-demo"): a tiny chat model that answers in words, for trying aserve without a download.

    Keyword arguments are `EngineArgs` fields: dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, enable_prefix_caching, kv_cache_memory, num_kv_blocks,
    seed, scheduling_policy, long_prefill_token_threshold, max_prefill_step_ratio and
    max_mixed_step_ratio (0, off, here: the server's 2 protect streaming readers, and an offline
    batch has none), tokenizer, device, async_scheduling,
    enforce_eager, warmup (False: no dummy prompts before serving), tensor_parallel_size,
    sequence_parallel_size, kv_transfer_config (a KV connector for disaggregated prefill:
    vLLM's keys, as a dict or its JSON text; a request's
    `SamplingParams.kv_transfer_params` then reaches it, and the producer's answer comes back
    in `RequestOutput.kv_transfer_params`), speculative_config (n-gram or suffix drafts, a
    draft model or an EAGLE head: vLLM's keys, as a dict or its JSON text; `stats()` counts
    the drafts), runner (auto | generate | pooling: `embed` and `score` need pooling, which
    auto picks for an embedding model's directory). With several
    ranks, `shutdown()` (or leaving a `with` block) stops them; they are also stopped when the
    interpreter exits.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if model is None:
            model = str(DEMO_MODEL_DIR)
            kwargs.setdefault("served_model_name", DEMO_MODEL_NAME)
        # Offline there is no reader to stutter: no per-step caps on prefill beside decodes, so
        # that every prompt of a batch starts at once and decodes batch fully (a higher output
        # rate; docs/benchmarks/serving-latency.md, "Offline: the caps off").
        # vLLM likewise picks other defaults for its LLM class than for its server.
        kwargs.setdefault("max_prefill_step_ratio", 0.0)
        kwargs.setdefault("max_mixed_step_ratio", 0.0)
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine_core = EngineCore(self.engine_args)
        self.tokenizer = Tokenizer.from_dir(self.engine_args.model_config().tokenizer_path)
        self.model_info = self.engine_core.model_info
        self.processor = Processor(
            self.tokenizer, self.model_info,
            any_whitespace=self.engine_args.structured_outputs_any_whitespace,
            kv_transfer_config=self.engine_args.kv_transfer_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker thread and ranks; the LLM is unusable afterwards."""
        self.engine_core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts), SamplingParams)
        results = self._run(prompts, params, priority)
        if self.engine_core.scheduler.has_kv_transfers():
            self.engine_core.step_kv_transfers()  # a producer's blocks: ready to be pulled
        return results

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None
              ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, floats; `outputs.data`, float32 numpy),
        pooled as its params say (the model's pooling and normalisation where they leave them
        unset). Needs the pooling runner."""
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = self._params_per_prompt(pooling_params, len(prompts), PoolingParams)
        return self._run(prompts, params, None)

    encode = embed  # (vLLM's name for pooling in general)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` for an embedding model: per pair (text_1 one text against each
        of text_2, or the i-th against the i-th), the cosine similarity of their
        embeddings (`outputs.score`). Needs the pooling runner."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        pairs = pair_indices(len(firsts), len(seconds))
        embedded = self.embed([*firsts, *seconds], pooling_params)
        one, two = embedded[:len(firsts)], embedded[len(firsts):]
        return [ScoringRequestOutput(str(k), ScoringOutput(cosine(one[i].outputs.data,
                                                                  two[j].outputs.data)),
                                     one[i].prompt_token_ids + two[j].prompt_token_ids)
                for k, (i, j) in enumerate(pairs)]

    def _run(self, prompts: list[PromptType], params: list, priority: Sequence[int] | None
             ) -> list:
        """Every prompt checked and prepared before the engine sees any (a bad one adds
        nothing), then run to the end; the outputs in prompt order."""
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError("priority must have one entry per prompt.")
        processed = [self.processor.process_prompt(p) for p in prompts]
        prepared = [self.processor.prepare(p, sp, prio)
                    for p, sp, prio in zip(processed, params, priority, strict=True)]
        request_ids = [self._add_request(p) for p in prepared]
        results = {r.request_id: r for r in self._run_engine()}
        return [results[request_id] for request_id in request_ids]

    def wait_for_kv_transfers(self, timeout: float | None = None) -> bool:
        """A KV producer: step until every block held for a consumer has been pulled, or
        given up (its lease expired); False if some are still held after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.engine_core.scheduler.has_kv_transfers():
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.engine_core.step_kv_transfers()
            time.sleep(KV_IDLE_POLL_S)
        return True

    @staticmethod
    def _params_per_prompt(params, num_prompts: int, kind: type) -> list:
        """One `kind` (SamplingParams or PoolingParams) per prompt: the default, one for all,
        or one each."""
        if params is None:
            return [kind()] * num_prompts
        if isinstance(params, kind):
            return [params] * num_prompts
        params = list(params)
        if len(params) != num_prompts:
            raise ValueError(f"Got {len(params)} {kind.__name__} for {num_prompts} prompts.")
        return params

    def _add_request(self, prepared: PreparedRequest) -> str:
        request_id = str(next(self._request_counter))
        parent, requests = self.processor.make_requests(request_id, prepared)
        self.output_processor.add_request(parent, [r.request_id for r in requests])
        for request in requests:
            self.engine_core.add_request(request)
        return request_id

    def _run_engine(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        while self.output_processor.has_unfinished_requests():
            if not self.engine_core.has_work():
                raise RuntimeError("The engine finished every request but some outputs are "
                                   "missing: this is a bug in aserve.")
            outputs = self.engine_core.step()
            done, to_abort = self.output_processor.process_outputs(outputs)
            finished.extend(done)
            if to_abort:
                self.engine_core.abort_requests(to_abort)
        return finished

    def stats(self) -> SchedulerStats:
        return self.engine_core.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()
