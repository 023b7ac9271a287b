"""`EagleDrafter`: speculative decoding's `eagle` and `eagle3` methods, the runner's side. An
EAGLE head (`models/eagle.py`) drafts from the target's hidden states, after each step:

    step N   target forward over the step's rows, keeping its hidden states (EAGLE-1: the final
             ones; EAGLE-3: the residual streams of three layers, `DecoderStack.capture`);
             verify and sample (the accepted drafts, then t)
    pass 1   the head over every request's rows up to its last accepted one, each row p taking
             (the token at p + 1, the target's hidden at p): rows of a prefill chunk write the
             head's K/V for later steps; the last row (token t) gives d1
    pass j   (d_{j-1}, the head's own output of pass j - 1) at the next position -> d_j, for
             requests the scheduler asked drafts of, batched one token each
    step N+1 the target verifies t, d1..dk (`spec_verify.py`: drafts as one-hot, exact)

Rows of rejected drafts never reach the head; their K/V slots are written again by the passes
and the next step. Like the draft model, the head keeps K/V buffers indexed by the target's
full-attention block ids (`spec_draft.PagedDrafter`), so prefix hits and preemption serve it
too, and it rests (its K/V of those positions unwritten) while the cost policy stops
drafting. Greedy drafts are one-hot, as vLLM's EAGLE proposer treats them.

Under tensor, pipeline or sequence parallelism the head lives on rank 0 alone, whole, as the
draft model does; what it reads of the target comes to rank 0:

    hidden states   `TargetStreams`, on every rank: each stage keeps the streams of its
                    layers (the last stage: the final hidden states), every row of the step
                    (gathered over its SP group), and its first rank sends them to rank 0,
                    which takes them, in layer order, before the step's logits
    vocabulary      `whole_vocab_tables`, once at load, before weights are packed: the
                    embedding (and EAGLE-1's untied LM head) all-gathered over the TP group,
                    the LM head sent on from the last stage
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from aserve.backends import Platform
from aserve.config import ModelConfig
from aserve.distributed import (
    get_pp_rank,
    get_pp_size,
    get_sp_size,
    get_tp_size,
    is_first_rank,
    recv_from_stage,
    send_to_stage,
    single_rank,
    stage_layers,
    tp_all_gather,
)
from aserve.distributed.state import stage_rank
from aserve.layers import bind_ops
from aserve.layers.embedding import LMHead, VocabEmbedding
from aserve.models.arch_config import ModelArchConfig
from aserve.models.eagle import (
    EagleHead,
    aux_layer_ids,
    read_eagle_checkpoint,
    read_eagle_config,
    uses_aux_hidden,
)
from aserve.models.loader import default_dtype
from aserve.runner.input_batch import PreparedInputs
from aserve.runner.request_state import CachedRequestState
from aserve.runner.sequence_parallel import gather_rows
from aserve.runner.spec_draft import PagedDrafter

VocabTables = tuple[torch.Tensor, torch.Tensor | None]  # embedding, EAGLE-1's untied LM head


def _version(method: str) -> int:
    return 3 if method == "eagle3" else 1


def whole_vocab_tables(target: torch.nn.Module, method: str) -> VocabTables | None:
    """Every rank, under tensor or pipeline parallelism, before the target's weights are
    packed: the target's embedding table and (EAGLE-1, untied) its LM head's, whole, on rank 0
    (None elsewhere, and with one rank a stage unsplit: the head reads the target's modules)."""
    if get_tp_size() == 1 and get_pp_size() == 1:
        return None
    arch, stack = target.arch, target.model
    stage, last = get_pp_rank(), get_pp_size() - 1

    def whole(module: torch.nn.Module, what: str) -> torch.Tensor:
        weight = module.weight.data
        if not weight.is_floating_point() or weight.dim() != 2:
            raise ValueError(f"an EAGLE head under tensor or pipeline parallelism reads the "
                             f"target's {what} as floats; this checkpoint holds it as "
                             f"{weight.dtype}.")
        return tp_all_gather(weight, dim=0)[:arch.vocab_size]  # [vocab, hidden]

    embedding = whole(stack.embed_tokens, "embedding") if stage == 0 else None
    lm_head = None
    if _version(method) == 1 and not arch.tie_word_embeddings:
        if stage == last:
            lm_head = whole(target.lm_head, "LM head")
            if last > 0 and stage_rank() == 0:
                send_to_stage([lm_head], 0)
        elif stage == 0 and is_first_rank():
            shape = (arch.vocab_size, arch.hidden_size)
            lm_head = recv_from_stage([shape], embedding.dtype, embedding.device, last)[0]
    return (embedding, lm_head) if is_first_rank() else None


class TargetStreams:
    """The target's hidden states an EAGLE head reads, every row of each step, brought to rank
    0 (module docstring): EAGLE-3's residual streams entering `layers`, else (no layers) the
    final hidden states. Built on every rank; `after_forward` on every rank after each step's
    forward, `collect` on rank 0 once for each such step, in order."""

    def __init__(self, target: torch.nn.Module, layers: tuple[int, ...]) -> None:
        self.stack, self.layers = target.model, layers
        self.hidden_size, self.dtype = target.arch.hidden_size, target.arch.dtype
        if layers:
            self.stack.capture(layers)
        num_layers, last = target.arch.num_layers, get_pp_size() - 1
        # how many streams each stage holds, in layer order
        self.counts = [sum(i in stage_layers(num_layers, s) for i in layers) if layers
                       else int(s == last) for s in range(last + 1)]
        self.held: list[list[torch.Tensor]] = []  # rank 0: its own, per step not yet collected

    def after_forward(self, out: torch.Tensor | tuple, num_rows: int) -> None:
        """This stage's streams of the step just run (`out`: its output, `num_rows` the
        step's rows): kept (rank 0) or sent to rank 0 (another stage's first rank)."""
        stage = get_pp_rank()
        if self.layers:
            mine = list(self.stack.aux_hidden)
        else:
            mine = [out] if stage == get_pp_size() - 1 else []
        if get_sp_size() > 1 and mine:  # every row, from the SP ranks holding them
            every = np.arange(num_rows)
            mine = [gather_rows(h, every, num_rows) for h in mine]
        if stage == 0:
            if is_first_rank():
                self.held.append(mine)
        elif mine and stage_rank() == 0:
            send_to_stage(mine, 0)

    def collect(self, num_rows: int, device: torch.device) -> list[torch.Tensor]:
        """Rank 0: the oldest uncollected step's streams, in layer order (each [rows, H])."""
        streams = self.held.pop(0)
        for stage, count in enumerate(self.counts[1:], start=1):
            if count:
                streams += recv_from_stage([(num_rows, self.hidden_size)] * count,
                                           self.dtype, device, stage)
        return streams


def target_streams(model_config: ModelConfig, method: str,
                   target: torch.nn.Module) -> TargetStreams:
    """The streams an EAGLE head of `model_config` reads of `target` (every rank)."""
    config = read_eagle_config(Path(model_config.model))
    layers = (aux_layer_ids(config, target.arch.num_layers)
              if uses_aux_hidden(config, _version(method)) else ())
    return TargetStreams(target, layers)


class EagleDrafter(PagedDrafter):
    def __init__(self, model_config: ModelConfig, method: str, target: torch.nn.Module,
                 platform: Platform, device: torch.device, num_tokens: int,
                 vocab: VocabTables | None = None) -> None:
        """`vocab`: the target's tables, whole (`whole_vocab_tables`), where its own modules
        are shards."""
        super().__init__(device, num_tokens)
        config, tensors = read_eagle_checkpoint(Path(model_config.model))
        dtype, version = target.arch.dtype, _version(method)
        with default_dtype(dtype), torch.device(device), single_rank():
            head = EagleHead(config, version, target, "embed_tokens.weight" in tensors)
            tables = () if vocab is None else self._vocab_modules(vocab, target.arch, version)
        if tables:
            head.read_vocabulary(*tables)
        head.load({name: t.to(dtype) if t.is_floating_point() else t
                   for name, t in tensors.items()})
        self.model = head.eval()
        self.arch = replace(head.arch, dtype=dtype)
        self.ops = platform.kernel_ops(dtype)
        with single_rank():
            for module in (self.model, *tables):
                if module is not None:
                    bind_ops(module, self.ops)
        if head.num_aux:
            ids = aux_layer_ids(config, target.arch.num_layers)
            if len(ids) != head.num_aux:
                raise ValueError(f"the EAGLE-3 head's fc reads {head.num_aux} hidden states, "
                                 f"its config names {len(ids)} layers.")

    @staticmethod
    def _vocab_modules(vocab: VocabTables, arch: ModelArchConfig, version: int
                       ) -> tuple[VocabEmbedding, LMHead | None]:
        """An embedding of the whole table and (EAGLE-1) an LM head, its own table's or tied
        to the embedding (EAGLE-3 reads its own LM head)."""
        embedding = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        embedding.weight.data.copy_(vocab[0])
        if version == 3:
            return embedding, None
        lm_head = LMHead(arch.vocab_size, arch.hidden_size)
        if vocab[1] is None:
            lm_head.tie_to(embedding)
        else:
            lm_head.weight.data.copy_(vocab[1])
        return embedding, lm_head

    def propose(self, states: list[CachedRequestState], inputs: PreparedInputs,
                accepted: dict[str, int], hidden: list[torch.Tensor], table: np.ndarray,
                num_groups: int, counts: dict[str, int]
                ) -> tuple[dict[str, list[int]], int, float]:
        """Pass 1 over the step's rows (`inputs`, after verification: `accepted` drafts a
        request) and the decode passes after it; `table`: the full group's block table of
        `states` (rows in order), `hidden`: the step's `TargetStreams`. Returns the drafts of each
        request `counts` asks drafts of (at most its count), and the passes that cost what
        drafting costs a step with their seconds: pass 1 only where the step decodes (over a
        prompt's chunk it is part of the prefill, which the head keeps up with anyway), and
        every decode pass."""
        with single_rank():
            return self._propose(states, inputs, accepted, hidden, table, num_groups, counts)

    def _propose(self, states: list[CachedRequestState], inputs: PreparedInputs,
                 accepted: dict[str, int], hidden: list[torch.Tensor], table: np.ndarray,
                 num_groups: int, counts: dict[str, int]
                 ) -> tuple[dict[str, list[int]], int, float]:
        began = time.perf_counter()
        num_drafts = dict(inputs.spec_drafts)
        qsl, positions = inputs.query_start_loc, inputs.positions
        rows: list[np.ndarray] = []
        ids: list[int] = []
        kept, requests = [], []
        for i, state in enumerate(states):
            start, end = int(qsl[i]), int(qsl[i + 1])
            rejected = len(num_drafts.get(i, ())) - accepted.get(state.req_id, 0)
            first = int(positions[start])
            n = min(end - start - rejected, state.num_tokens - 1 - first)  # next token known
            if n <= 0:
                continue
            rows.append(np.arange(start, start + n))
            ids += state.all_token_ids[first + 1:first + 1 + n]
            kept.append(n)
            requests.append(i)
        if not requests:
            return {}, 0, 0.0
        row_index = np.concatenate(rows)
        query_lens = np.array(kept, dtype=np.int32)
        pos = positions[row_index].astype(np.int64)
        ends = np.cumsum(query_lens) - 1  # each request's last row in the pass
        seq_lens = pos[ends] + 1
        slots = inputs.slot_mappings[self.group][row_index]
        metadata = self.metadata(table[requests], query_lens, seq_lens, slots, num_groups)
        index = self._tensor(row_index)
        head_input = self.model.combine([h[index] for h in hidden])
        out, carry = self.model(self._tensor(np.asarray(ids, dtype=np.int64)),
                                self._tensor(pos), head_input, metadata)
        passes, seconds = 0, 0.0
        if max(kept) <= 1 + self.k:  # a decode step's pass 1 (one row and its drafts each)
            passes, seconds = 1, time.perf_counter() - began
        began = time.perf_counter()
        # the requests that draft, and where: the position of their sampled token
        drafting = [(j, counts[states[i].req_id]) for j, i in enumerate(requests)
                    if counts.get(states[i].req_id, 0) > 0]
        drafts: dict[str, list[int]] = {}
        if not drafting:
            return drafts, passes, seconds
        active = [j for j, _ in drafting]
        limit = dict(drafting)
        last = self._tensor(ends[active])
        out, carry = out[last], carry[last]
        where = {j: int(seq_lens[j]) for j in active}  # the next pass's position
        for step in range(min(self.k, max(limit.values()))):
            chosen = self.model.to_target(self.ops.argmax(self.model.compute_logits(out)))
            for j, token in zip(active, chosen.tolist(), strict=True):
                drafts.setdefault(states[requests[j]].req_id, []).append(int(token))
            keep = [a for a, j in enumerate(active) if limit[j] > step + 1
                    and self.covered(table, requests[j], where[j])]
            if not keep or step + 1 >= self.k:
                break
            active = [active[a] for a in keep]
            pick = self._tensor(np.asarray(keep, dtype=np.int64))
            tokens, carry = chosen[pick], carry[pick]
            step_pos = np.array([where[j] for j in active], dtype=np.int64)
            metadata = self.decode_metadata(table[[requests[j] for j in active]], step_pos,
                                            num_groups)
            out, carry = self.model(tokens, self._tensor(step_pos), carry, metadata)
            passes += 1
            for j in active:
                where[j] += 1
        return drafts, passes, seconds + time.perf_counter() - began
