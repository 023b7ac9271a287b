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
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from aserve.backends import Platform
from aserve.config import ModelConfig
from aserve.layers import bind_ops
from aserve.models.eagle import EagleHead, aux_layer_ids, read_eagle_checkpoint
from aserve.models.loader import default_dtype
from aserve.runner.input_batch import PreparedInputs
from aserve.runner.request_state import CachedRequestState
from aserve.runner.spec_draft import PagedDrafter


class EagleDrafter(PagedDrafter):
    def __init__(self, model_config: ModelConfig, method: str, target: torch.nn.Module,
                 platform: Platform, device: torch.device, num_tokens: int) -> None:
        super().__init__(device, num_tokens)
        config, tensors = read_eagle_checkpoint(Path(model_config.model))
        version = 3 if method == "eagle3" else 1
        dtype = target.arch.dtype
        with default_dtype(dtype), torch.device(device):
            head = EagleHead(config, version, target, "embed_tokens.weight" in tensors)
        head.load({name: t.to(dtype) if t.is_floating_point() else t
                   for name, t in tensors.items()})
        self.model = head.eval()
        self.arch = replace(head.arch, dtype=dtype)
        self.ops = platform.kernel_ops(dtype)
        bind_ops(self.model, self.ops)
        self.stack = target.model  # the target's decoder stack, whose hidden states it reads
        if version == 3 and head.num_aux:
            ids = aux_layer_ids(config, target.arch.num_layers)
            if len(ids) != head.num_aux:
                raise ValueError(f"the EAGLE-3 head's fc reads {head.num_aux} hidden states, "
                                 f"its config names {len(ids)} layers.")
            self.stack.capture(ids)

    def target_hidden(self, final: torch.Tensor) -> list[torch.Tensor]:
        """The target's hidden states of the step just run (every row), as the head reads."""
        if self.model.version == 3 and self.model.num_aux:
            return list(self.stack.aux_hidden)
        return [final]

    def propose(self, states: list[CachedRequestState], inputs: PreparedInputs,
                accepted: dict[str, int], hidden: list[torch.Tensor], table: np.ndarray,
                num_groups: int, counts: dict[str, int]
                ) -> tuple[dict[str, list[int]], int, float]:
        """Pass 1 over the step's rows (`inputs`, after verification: `accepted` drafts a
        request) and the decode passes after it; `table`: the full group's block table of
        `states` (rows in order), `hidden`: `target_hidden`'s. Returns the drafts of each
        request `counts` asks drafts of (at most its count), and the passes that cost what
        drafting costs a step with their seconds: pass 1 only where the step decodes (over a
        prompt's chunk it is part of the prefill, which the head keeps up with anyway), and
        every decode pass."""
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
