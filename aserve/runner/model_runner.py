"""`ModelRunner`: one step of one rank — scheduler output in, sampled tokens out.

It keeps its own `CachedRequestState` for each running request and their block tables
(`BlockTables`; the scheduler sends new requests whole and running ones as diffs), flattens the
scheduled tokens into one ragged batch, runs the model, computes logits only where a request
samples, and samples. Two features that cut across the step are objects of their own, called
the same way whether on or off: the constrained rows' masks (`GrammarMasks`) and the KV
connector's hooks (`KVConnectorHooks`, or `NO_OP_KV_CONNECTOR`). The pooling runner
(`--runner pooling`: a model without LM head) ends each step in its `Pooler` instead of the
logits and the sampler: `run_model` hands back the final hidden states and `finish_step` the
pooled vectors.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import torch

from aserve.backends import Platform
from aserve.config import DraftConfig, KVCacheGroupSpec, ModelConfig
from aserve.core.kv_connector import KVConnectorOutput
from aserve.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from aserve.distributed import (
    get_pp_rank,
    get_pp_size,
    get_sp_rank,
    get_tp_rank,
    is_first_rank,
    recv_from_stage,
    send_to_stage,
    stage_layers,
)
from aserve.kv_transfer import KVConnectorBase
from aserve.layers import bind_ops
from aserve.layers.attention import AttentionMetadata
from aserve.models import load_model
from aserve.models.loader import describe_quantization
from aserve.runner.block_table import BlockTables
from aserve.runner.grammar_masks import NO_MASKS, GrammarMasks, TokenMasks
from aserve.runner.graphs import DecodeGraphs
from aserve.runner.input_batch import PreparedInputs, pad_to_bucket, prepare_inputs
from aserve.runner.kv_cache import allocate_kv_buffers, kv_buffer_ids, layer_placement
from aserve.runner.kv_connector_hooks import (
    NO_OP_KV_CONNECTOR,
    KVConnectorHooks,
    NoOpKVConnectorHooks,
)
from aserve.runner.pooler import Pooler
from aserve.runner.request_state import CachedRequestState
from aserve.runner.sampler import Sampler, compute_prompt_logprobs, gather_logprobs
from aserve.runner.sampling_metadata import SamplingMetadata, SamplingParamsCache
from aserve.runner.sequence_parallel import gather_rows, local_rows
from aserve.runner.spec_draft import DraftModel
from aserve.runner.spec_eagle import EagleDrafter, target_streams, whole_vocab_tables
from aserve.runner.spec_verify import verify_drafts
from aserve.structured_output import apply_token_bitmask

T = TypeVar("T")


def _rows(items: list[T], indices: list[int]) -> list[T]:
    """`items` at `indices` (ascending): `items` itself where that is all of them (most
    steps: every request samples)."""
    return items if len(indices) == len(items) else [items[i] for i in indices]


def _no_grad(method: Callable[..., T]) -> Callable[..., T]:
    """Run a runner method without autograd: `inference_mode` where the platform allows it."""
    @functools.wraps(method)
    def wrapper(self: ModelRunner, *args, **kwargs):
        mode = torch.inference_mode if self.platform.supports_inference_mode else torch.no_grad
        with mode():
            return method(self, *args, **kwargs)
    return wrapper


@dataclass
class StartedStep:
    """A step whose forward has started on this rank (none: no token scheduled, `req_ids`
    empty); `logits` is None until received."""

    req_ids: list[str]
    states: list[CachedRequestState]
    inputs: PreparedInputs | None
    logits: torch.Tensor | None
    start: float
    masks: TokenMasks  # the constrained rows (their bitmask filled beside the forward)
    kv_output: KVConnectorOutput | None = None  # every rank's, with a KV connector
    num_draft_tokens: dict[str, int] | None = None  # the draft model's drafts to propose
    draft_model_runs: bool = False  # the draft model (EAGLE head) keeps up this step


class ModelRunner:
    """`publish_inputs`: rank 0 of several ranks hands each step's inputs to the others with it,
    just before running them, so that every rank runs the same forward (None: one rank, or a
    rank > 0, which receives its inputs instead); with a KV connector, the step's connector
    metadata too, and `gather_kv_reports` then collects the other ranks' reports after it.

    `kv_hooks` (a connector's, once the `Worker` binds one with `bind_kv_connector`) run
    around each step: loads before the forward, saves and the step's report after it; a step
    that schedules no token still runs them, so that loads start and leases expire."""

    def __init__(self, model_config: ModelConfig, block_size: int, platform: Platform,
                 device: torch.device,
                 publish_inputs: Callable[..., None] | None = None,
                 gather_kv_reports: Callable[[], list[KVConnectorOutput]] | None = None,
                 draft: DraftConfig | None = None) -> None:
        self.platform = platform
        self.device = device
        self.block_size = block_size
        self.model, self.arch = load_model(model_config, self.device,
                                           platform.quantized_float16_as)
        self.model.eval()
        eagle = draft is not None and draft.method != "draft_model"
        # (before packing: an EAGLE head under TP or PP reads the target's tables whole)
        vocab = whole_vocab_tables(self.model, draft.method) if eagle else None
        # every kernel of this dtype, compiled now (not in the middle of a request), bound to
        # the layers once; linear weights packed where the platform packs them
        self.ops = platform.kernel_ops(self.arch.dtype)
        bind_ops(self.model, self.ops)
        self.quantization = describe_quantization(self.model, model_config.model,
                                                  self.arch.dtype)
        self.vocab_size = self.arch.vocab_size
        self.sampler = Sampler(argmax=self.ops.argmax, random_sampling=self.ops.random_sampling,
                               top_p_candidates=self.ops.top_p_candidates)
        self.sampling_params_cache = SamplingParamsCache()  # (the sampled rows' only)
        self.generator = torch.Generator(device=platform.generator_device(self.device))
        self.generator.manual_seed(model_config.seed)
        self.requests: dict[str, CachedRequestState] = {}
        self.prompt_logprob_req_ids: set[str] = set()  # (those of `requests` that ask)
        self.block_tables = BlockTables(num_groups=1)
        self.kv_caches: list[torch.Tensor] = []  # this stage's KV buffers
        self.num_kv_groups = 1
        self.graphs: DecodeGraphs | None = None
        self.publish_inputs = publish_inputs
        self.gather_kv_reports = gather_kv_reports
        self.kv_hooks: KVConnectorHooks | NoOpKVConnectorHooks = NO_OP_KV_CONNECTOR
        self.kv_caches_by_layer: dict[int, torch.Tensor] = {}  # model layer → its buffer
        self.grammar_masks = GrammarMasks(self.vocab_size, device,
                                          check_greedy_tokens=platform.computes_on_host)
        # the pooling runner's end of each step (None: this runner samples)
        self.pooler = Pooler(device) if model_config.pooler is not None else None
        # speculative decoding's draft model (`spec_draft.py`) or EAGLE head (`spec_eagle.py`),
        # on rank 0 (which samples; it drafts for all); None: drafts, if any, come from the
        # scheduler's lookups. `streams`: the target's hidden states the EAGLE head reads
        self.streams = target_streams(draft.model, draft.method, self.model) if eagle else None
        self.drafter: DraftModel | EagleDrafter | None = None
        if draft is not None and is_first_rank():
            self.drafter = (DraftModel(draft.model, platform, device, self.vocab_size,
                                       draft.num_tokens) if draft.method == "draft_model"
                            else EagleDrafter(draft.model, draft.method, self.model, platform,
                                              device, draft.num_tokens, vocab))

    @property
    def kv_connector(self) -> KVConnectorBase | None:
        """This rank's worker side of the KV connector (None: none)."""
        return self.kv_hooks.connector

    def bind_kv_connector(self, connector: KVConnectorBase) -> None:
        """Run `connector`'s worker side around every step (after `initialize_kv_cache`)."""
        connector.register_kv_caches(self.kv_caches_by_layer)
        self.kv_hooks = KVConnectorHooks(connector, self.kv_caches_by_layer,
                                         self.publish_inputs, self.gather_kv_reports)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (its tensor-parallel share)."""
        return self.model.attention_layers()[0].num_kv_heads

    def initialize_kv_cache(self, num_blocks: int,
                            kv_cache_groups: Sequence[KVCacheGroupSpec]) -> None:
        """Allocate this stage's KV buffers and bind each attention layer to its buffer and
        group (`runner/kv_cache.py`)."""
        self.num_kv_groups = len(kv_cache_groups)
        self.block_tables = BlockTables(self.num_kv_groups)
        layers = dict(zip(stage_layers(self.arch.num_layers), self.model.attention_layers(),
                          strict=True))
        placement = layer_placement(kv_cache_groups)
        buffers = allocate_kv_buffers(self.arch, num_blocks, self.block_size,
                                      kv_buffer_ids(kv_cache_groups, layers), self.num_kv_heads,
                                      self.device)
        self.kv_caches = list(buffers.values())
        self.kv_caches_by_layer = {layer_id: buffers[placement[layer_id][1]]
                                   for layer_id in layers}
        for layer_id, layer in layers.items():
            group, buffer_id = placement[layer_id]
            if layer.sliding_window != kv_cache_groups[group].sliding_window:
                raise ValueError(f"layer {layer_id} has window {layer.sliding_window}, its KV "
                                 f"cache group {kv_cache_groups[group].sliding_window}.")
            layer.bind_kv_cache(buffers[buffer_id], group)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, self.block_size, list(kv_cache_groups))

    def capture_graphs(self, capture_sizes: list[int], max_blocks_per_seq: int,
                       num_speculative_tokens: int = 0) -> None:
        """Capture decode-only forwards of these batch sizes (after the KV cache is bound),
        and verification steps of k drafts a request; none under an EAGLE-3 head, which reads
        hidden states from inside the stack."""
        if self.model.model.aux_layer_ids:
            return
        self.graphs = DecodeGraphs(self.model, self.platform, self.device, capture_sizes,
                                   max_blocks_per_seq, self.num_kv_groups,
                                   num_speculative_tokens)
        self.graphs.capture()

    @_no_grad
    def profile_run(self, num_tokens: int, num_reqs: int) -> None:
        """A forward of the largest step (`num_tokens` tokens in `num_reqs` requests) and its
        logits, with no KV cache bound: what activations can take at most, for sizing the cache."""
        num_reqs = max(1, min(num_reqs, num_tokens))
        query_lens = [num_tokens // num_reqs] * num_reqs
        query_lens[-1] += num_tokens - sum(query_lens)
        starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        positions = np.concatenate([np.arange(n) for n in query_lens]).astype(np.int64)
        metadata = AttentionMetadata(
            query_start_loc=self._tensor(starts), seq_lens=self._tensor(starts[1:] - starts[:-1]),
            block_table=torch.zeros(num_reqs, 1, dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            max_query_len=max(query_lens), max_seq_len=max(query_lens),
            query_start_loc_cpu=starts.tolist(), seq_lens_cpu=list(query_lens))
        positions = local_rows(positions)  # (this rank's rows under sequence parallelism)
        input_ids = torch.zeros(len(positions), dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, self._tensor(positions), metadata)
        last_rows = starts[1:].astype(np.int64) - 1
        if self.pooler is None:  # (a pooling model has no LM head)
            self.model.compute_logits(gather_rows(hidden, last_rows, num_tokens))
        self.platform.synchronize(self.device)

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        self.block_tables.update(so)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprob_req_ids.discard(req_id)
        for new in so.scheduled_new_reqs:
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprob_req_ids.add(new.req_id)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=list(new.output_token_ids),
                stop_token_ids=new.stop_token_ids,
                compiled_grammar=new.grammar,
                pooling_params=new.pooling_params,
            )
        requests = self.requests
        for cached in so.scheduled_cached_reqs:
            requests[cached.req_id].num_computed_tokens = cached.num_computed_tokens

    # ------------------------------------------------------------------ step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish_step(self.start_step(so))

    @_no_grad
    def start_step(self, so: SchedulerOutput) -> StartedStep:
        """Everything up to the logits: states, inputs (sent to the other ranks), this rank's
        forward. Under pipeline parallelism the logits come later, in `finish_step`, so that
        the next batch can start on this stage while the later stages run this one."""
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:  # no forward: the KV connector's part alone (nothing without one)
            kv_output = self.kv_hooks.step_without_forward(so.kv_connector_metadata,
                                                           so.finished_req_ids)
            return StartedStep([], [], None, None, 0.0, NO_MASKS, kv_output)
        states = list(map(self.requests.__getitem__, req_ids))  # (C-level: no bytecode a row)
        spec = so.scheduled_spec_decode_tokens
        inputs = prepare_inputs(states, list(so.num_scheduled_tokens.values()),
                                self.block_tables.gather(req_ids), self.block_size,
                                [spec.get(r, []) for r in req_ids] if spec else None,
                                bool(self.prompt_logprob_req_ids))
        if self.platform.static_shapes:
            inputs = pad_to_bucket(inputs)
        if self.publish_inputs is not None:
            self.publish_inputs(inputs, so.kv_connector_metadata)
        masks = self.grammar_masks.start(_rows(states, inputs.sample_req_indices),
                                         inputs.sampling_row_drafts())
        self.kv_hooks.before_forward(so.kv_connector_metadata)
        start = time.perf_counter()
        logits = self.run_model(inputs)  # [num_logits_rows, vocab], None: from the last stage
        if isinstance(self.drafter, DraftModel) and so.draft_model_runs:  # its K/V of the
            # same tokens (while the cost policy stops drafting, under load, the draft model
            # rests: its K/V of those steps' positions stays unwritten, and a request's later
            # drafts over them are rejected more, which its acceptance then shows)
            self.drafter.forward(self._tensor(inputs.input_ids), self._tensor(inputs.positions),
                                 self._attn_metadata(inputs))
        # (the saves: with one pipeline stage the forward is done here)
        kv_output = self.kv_hooks.after_forward(so.finished_req_ids, gather=True)
        return StartedStep(req_ids, states, inputs, logits, start, masks, kv_output,
                           so.num_draft_tokens, so.draft_model_runs)

    @_no_grad
    def run_rank_step(self, inputs: PreparedInputs | None, metadata) -> KVConnectorOutput:
        """A rank > 0's step with a KV connector: its part of the transfers around the same
        forward as rank 0's (none when `inputs` is None); returns its report."""
        self.kv_hooks.before_forward(metadata)
        if inputs is not None:
            self.run_model(inputs)
        return self.kv_hooks.after_forward(set(), gather=False)

    @_no_grad
    def finish_step(self, step: StartedStep) -> ModelRunnerOutput:
        """The logits (received from the last stage if need be), sampling, prompt logprobs."""
        if not step.req_ids:  # no forward: the KV connector's report alone (None without one)
            return ModelRunnerOutput([], [], kv_connector_output=step.kv_output)
        if self.pooler is not None:  # the pooling runner: vectors, nothing sampled
            return self.pooler.finish(step)
        states, inputs, logits = step.states, step.inputs, step.logits
        # (the EAGLE head's streams come before the logits from the last stage)
        streams = (self.streams.collect(len(inputs.input_ids), self.device)
                   if self.streams is not None else None)
        if logits is None:
            logits = self.receive_logits(len(inputs.logits_indices))
        forward_seconds = time.perf_counter() - step.start
        num_sampling = len(inputs.sample_req_indices)
        num_drafts = sum(len(d) for _, d in inputs.spec_drafts)
        prompt_logprobs = self._prompt_logprobs(
            states, inputs, logits[num_sampling:len(logits) - num_drafts])
        sampled: list[int | None] = [None] * len(step.req_ids)
        logprobs: dict[str, LogprobsLists] = {}
        accepted: dict[str, int] = {}
        if num_sampling:
            sample_states = _rows(states, inputs.sample_req_indices)
            token_ids = self._sample(sample_states, logits[:num_sampling], logprobs, step.masks,
                                     inputs.sampling_row_drafts())
            if num_sampling == len(sampled):  # (most steps: every row samples)
                sampled = token_ids
            else:
                for i, token_id in zip(inputs.sample_req_indices, token_ids):
                    sampled[i] = token_id
            if num_drafts:
                draft_logits = logits[len(logits) - num_drafts:]
                rows, bitmask = self.grammar_masks.draft_bitmask(states, inputs.spec_drafts)
                if rows:  # constrained requests' drafts, checked against their grammars
                    draft_logits = apply_token_bitmask(
                        draft_logits, bitmask, torch.tensor(rows).to(draft_logits.device))
                verified = self._verify(states, inputs, draft_logits, sampled)
                self._draft_logprobs(states, inputs, draft_logits, verified, logprobs)
                for (i, drafts), (n, token_id) in zip(inputs.spec_drafts, verified):
                    accepted[states[i].req_id], sampled[i] = n, token_id
                    for draft in drafts[:n]:
                        states[i].append_output_token_id(draft)
            if not num_drafts and step.masks is NO_MASKS:  # (no grammar: the appends inline)
                for state, token_id in zip(sample_states, token_ids):
                    state.output_token_ids.append(token_id)
                    state.all_token_ids.append(token_id)
            else:
                for i in inputs.sample_req_indices:
                    states[i].append_output_token_id(sampled[i])
        output = ModelRunnerOutput(step.req_ids, sampled, logprobs, prompt_logprobs,
                                   forward_seconds, step.kv_output, accepted)
        if isinstance(self.drafter, EagleDrafter) and step.draft_model_runs:
            table = self.block_tables.gather(step.req_ids)[self.drafter.group]
            output.draft_token_ids, output.draft_passes, output.draft_seconds = (
                self.drafter.propose(states, inputs, accepted, streams, table,
                                     self.num_kv_groups, step.num_draft_tokens or {}))
        elif num_sampling and step.num_draft_tokens:
            start = time.perf_counter()
            output.draft_token_ids, output.draft_passes = self._draft(
                states, inputs.sample_req_indices, step.num_draft_tokens)
            output.draft_seconds = time.perf_counter() - start
        return output

    def _draft(self, states: list[CachedRequestState], rows: list[int],
               counts: dict[str, int]) -> tuple[dict[str, list[int]], int]:
        """The draft model's drafts to follow the new token of each sampling request the
        scheduler asked drafts of (`counts`), and the passes that took."""
        if not isinstance(self.drafter, DraftModel):
            return {}, 0
        chosen = [states[i] for i in rows if counts.get(states[i].req_id, 0) > 0]
        if not chosen:
            return {}, 0
        tables = self.block_tables.gather([s.req_id for s in chosen])
        drafts, passes = self.drafter.propose(
            [s.all_token_ids[-1] for s in chosen], [s.num_tokens - 1 for s in chosen], tables,
            self.num_kv_groups, [counts[s.req_id] for s in chosen])
        return {s.req_id: d for s, d in zip(chosen, drafts, strict=True) if d}, passes

    @staticmethod
    def _draft_logprobs(states: list[CachedRequestState], inputs: PreparedInputs,
                        logits: torch.Tensor, verified: list[tuple[int, int]],
                        logprobs: dict[str, LogprobsLists]) -> None:
        """The logprob rows of a speculating request's tokens, for requests that ask: its
        accepted drafts' rows and, when a draft was rejected, the row of the token drawn in its
        place, before the row the sampler gave (the token after all drafts), which is kept
        only when every draft was accepted. Of the raw logits, as the sampler's."""
        rows, chosen, asked = [], [], []
        offset = 0
        for (i, drafts), (n, token_id) in zip(inputs.spec_drafts, verified, strict=True):
            k = states[i].sampling_params.logprobs
            if k is not None:
                rows += range(offset, offset + min(n + 1, len(drafts)))
                chosen += [*drafts[:n], token_id][:min(n + 1, len(drafts))]
                asked.append((i, n, len(drafts), k))
            offset += len(drafts)
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        tensors = gather_logprobs(logits[index].log_softmax(dim=-1),
                                  torch.tensor(chosen, device=logits.device),
                                  max(k for *_, k in asked))
        lists = tensors.tolists(None, [k for i, n, d, k in asked
                                       for _ in range(min(n + 1, d))], merge=True)
        start = 0
        for i, n, num_drafts, _ in asked:
            count = min(n + 1, num_drafts)
            mine = LogprobsLists(lists.token_ids[start:start + count],
                                 lists.logprobs[start:start + count],
                                 lists.ranks[start:start + count])
            start += count
            req_id = states[i].req_id
            if n == num_drafts:  # every draft accepted: the sampler's row ends it
                last = logprobs[req_id]
                mine = LogprobsLists(mine.token_ids + last.token_ids,
                                     mine.logprobs + last.logprobs, mine.ranks + last.ranks)
            logprobs[req_id] = mine

    def _verify(self, states: list[CachedRequestState], inputs: PreparedInputs,
                logits: torch.Tensor, sampled: list[int | None]) -> list[tuple[int, int]]:
        """(drafts accepted, the token after them) per request of `inputs.spec_drafts`, from
        its draft rows of `logits` and the token its sampling row drew (`spec_verify.py`)."""
        rows = [states[i] for i, drafts in inputs.spec_drafts for _ in drafts]
        pending = [drafts[:j] for _, drafts in inputs.spec_drafts for j in range(len(drafts))]
        metadata = SamplingMetadata.build(rows, self.vocab_size, self.device,
                                          generator=self.generator, pending=pending)
        return verify_drafts(logits, [d for _, d in inputs.spec_drafts],
                             [sampled[i] for i, _ in inputs.spec_drafts], metadata,
                             self.sampler.argmax,
                             lambda probs, n: self.sampler.uniforms(probs, metadata, n))

    def receive_logits(self, num_rows: int) -> torch.Tensor:
        """Stage 0: the logits of a step, from the last stage."""
        if num_rows == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        shape = (num_rows, self.vocab_size)
        return recv_from_stage([shape], torch.float32, self.device, get_pp_size() - 1)[0]

    @_no_grad
    def run_model(self, inputs: PreparedInputs) -> torch.Tensor | None:
        """The forward and the logits of `inputs.logits_indices` (the pooling runner: the final
        hidden states of every row, [T, hidden]): every rank runs this on the
        same inputs (its collectives pair up), only rank 0 samples. Under pipeline parallelism
        each stage runs its layers and sends its hidden states on (without waiting for them to
        arrive); only the last stage returns logits, which it also sends back to stage 0. Under
        sequence parallelism a rank runs its slice of the rows (`runner/sequence_parallel.py`),
        the rows with logits are gathered over the SP group and the first SP rank's TP group
        computes the logits."""
        stage, num_stages = get_pp_rank(), get_pp_size()
        input_ids, positions = local_rows(inputs.input_ids), local_rows(inputs.positions)
        intermediate = None
        if stage > 0:
            shape = (len(input_ids), self.arch.hidden_size)
            hidden, residual = recv_from_stage([shape, shape], self.arch.dtype, self.device,
                                               stage - 1)
            intermediate = (hidden, residual)
        if self.graphs is not None and self.graphs.can_run(inputs):
            out = self.graphs.run(inputs)  # [num_tokens, hidden_size]
        else:
            out = self.model(self._tensor(input_ids), self._tensor(positions),
                             self._attn_metadata(inputs), intermediate)
        self.platform.mark_step()  # XLA: run the traced forward (KV-cache writes included) now
        if self.streams is not None:
            self.streams.after_forward(out, len(inputs.input_ids))
        if stage < num_stages - 1:
            send_to_stage(list(out), stage + 1)
            return None
        if self.pooler is not None:  # every row's final hidden state, for the pooler (one
            return out  # stage, no SP: the pooling runner refuses them; TP ranks hold all rows)
        hidden = gather_rows(out, inputs.logits_indices, len(inputs.input_ids))
        if get_sp_rank() > 0:
            return None  # (the first SP rank's logits are the ones sampled)
        logits = self.model.compute_logits(hidden)
        if stage > 0 and get_tp_rank() == 0 and len(inputs.logits_indices):
            send_to_stage([logits], 0)  # to rank 0, the one that samples (the other TP ranks'
            # logits are the same all-gathered ones, and nobody would receive them)
        return logits

    def _sample(self, states: list[CachedRequestState], logits: torch.Tensor,
                logprobs: dict[str, LogprobsLists], masks: TokenMasks,
                pending: list[list[int]] | None = None) -> list[int]:
        logits = self.grammar_masks.apply(logits, masks)  # [num_sampling_rows, vocab]
        metadata = SamplingMetadata.build(states, self.vocab_size, self.device,
                                          generator=self.generator, pending=pending,
                                          cache=self.sampling_params_cache)
        out = self.sampler(logits, metadata)
        if out.logprobs is not None:
            rows = [j for j, s in enumerate(states) if s.sampling_params.logprobs is not None]
            lists = out.logprobs.tolists(rows, [states[j].sampling_params.logprobs for j in rows])
            for j, row in zip(rows, lists):
                logprobs[states[j].req_id] = row
        token_ids = out.sampled_token_ids.tolist()
        self.grammar_masks.check(states, logits, token_ids, masks)
        return token_ids

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _attn_metadata(self, inputs: PreparedInputs) -> AttentionMetadata:
        """One metadata per KV cache group (the same query layout, the group's own block table
        and slot mapping); under one group that one itself."""
        shared = dict(
            query_start_loc=self._tensor(inputs.query_start_loc),
            seq_lens=self._tensor(inputs.seq_lens),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            query_start_loc_cpu=inputs.query_start_loc.tolist(),
            seq_lens_cpu=inputs.seq_lens.tolist(),
        )
        groups = [AttentionMetadata(block_table=self._tensor(table),
                                    slot_mapping=self._tensor(slots), **shared)
                  for table, slots in zip(inputs.block_tables, inputs.slot_mappings, strict=True)]
        if len(groups) == 1:
            return groups[0]
        return replace(groups[0], group_metadata=tuple(groups))

    def _prompt_logprobs(self, states: list[CachedRequestState], inputs: PreparedInputs,
                         logits: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens this step's chunks predict, for requests that ask;
        `logits` holds the rows of `inputs.prompt_logprob_spans`, in order."""
        result: dict[str, LogprobsLists] = {}
        offset = 0
        for i, start, num_rows in inputs.prompt_logprob_spans:
            state = states[i]
            k = state.sampling_params.prompt_logprobs
            targets = torch.tensor(state.prompt_token_ids[start + 1:start + 1 + num_rows],
                                   device=self.device)
            tensors = compute_prompt_logprobs(logits[offset:offset + num_rows], targets, k)
            result[state.req_id] = tensors.tolists(range(num_rows), [k] * num_rows, merge=True)
            offset += num_rows
        return result
