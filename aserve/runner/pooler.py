"""`Pooler`: the pooling runner's end of a step (`--runner pooling`), where the generate runner
samples. A pooling request is prefill only; its prompt comes in chunks (chunked prefill, batched
with others), and each chunk's final-norm hidden states feed its vector:

    step rows      r0 chunk 1 (c=0)      r1 whole prompt      r0 chunk 2 (its last)
    hidden [T, H]  a b c d               e f g                h i
    MEAN           sum += a+b+c+d                              sum += h+i ─► sum / prompt len
    CLS            first = a (c == 0)                          ─► first
    LAST                                 ─► g                  ─► i (its last prompt row)

A request's vector comes out in the step that computes its last prompt token (the rows that
"sample" in the generate runner: `PreparedInputs.sample_req_indices`), truncated to its
`dimensions` (Matryoshka) and then L2-normalised where its params say, in float32, and goes back
to the scheduler as a numpy array in `ModelRunnerOutput.pooler_output`. What earlier chunks
left (MEAN's running sum, CLS's first row) lives in the request's `CachedRequestState`, so a
preempted request, dropped with its state, starts again from nothing. MEAN and CLS requests take
no prefix-cache hit (`PoolingParams.needs_every_token`); LAST may, the last token is never one.

Per step the work is a handful of tensor ops over the rows (one `index_add_` for every MEAN
row, one gather of the LAST rows, one normalisation per distinct (dimensions, normalize)),
and Python per finishing request, not per row.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from aserve.core.outputs import ModelRunnerOutput
from aserve.runner.input_batch import PreparedInputs
from aserve.runner.request_state import CachedRequestState

if TYPE_CHECKING:
    from aserve.runner.model_runner import StartedStep


class Pooler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def finish(self, step: StartedStep) -> ModelRunnerOutput:
        """The step's output: the vectors of the requests whose prompt it completed, nothing
        sampled. `step.logits` holds the step's final hidden states [T, H] (`run_model`)."""
        states, inputs = step.states, step.inputs
        vectors = self.pool(states, inputs, step.logits)
        return ModelRunnerOutput(step.req_ids, [None] * len(step.req_ids),
                                 forward_seconds=time.perf_counter() - step.start,
                                 pooler_output=vectors)

    def pool(self, states: list[CachedRequestState], inputs: PreparedInputs,
             hidden: torch.Tensor) -> dict[str, np.ndarray]:
        """Feed every request's rows of `hidden` [T(+padding), H] to its pooling; return the
        vectors of the requests that end their prompt here, by request id."""
        starts = inputs.query_start_loc  # [R + 1]
        hidden = hidden[:int(starts[-1])]  # (XLA's padding rows: none of the requests')
        self._accumulate(states, starts, hidden)
        ending = inputs.sample_req_indices
        if not ending:
            return {}
        vectors = self._vectors(states, starts, ending, hidden)  # [F, H] float32
        groups: dict[tuple[int | None, bool], list[int]] = defaultdict(list)
        for j, i in enumerate(ending):
            params = states[i].pooling_params
            groups[(params.dimensions, bool(params.normalize))].append(j)
        out: dict[str, np.ndarray] = {}
        for (dimensions, normalize), rows in groups.items():
            group = vectors if len(groups) == 1 else vectors[rows]
            group = group[:, :dimensions]  # Matryoshka: truncate, then normalise
            if normalize:
                group = F.normalize(group, p=2.0, dim=-1)
            host = group.cpu().numpy()
            for row, j in enumerate(rows):
                out[states[ending[j]].req_id] = host[row]
        return out

    def _accumulate(self, states: list[CachedRequestState], starts: np.ndarray,
                    hidden: torch.Tensor) -> None:
        """What a request's later chunks need of this one: MEAN's sum over its rows, CLS's
        first row (its chunk starting at position 0)."""
        mean = [i for i, s in enumerate(states) if s.pooling_params.pooling_type == "MEAN"]
        if mean:
            lengths = np.diff(starts)
            owner = torch.from_numpy(np.repeat(np.arange(len(states)), lengths)).to(self.device)
            sums = torch.zeros(len(states), hidden.shape[1], dtype=torch.float32,
                               device=self.device).index_add_(0, owner, hidden.float())
            for i in mean:
                partial = states[i].pooling_partial
                states[i].pooling_partial = sums[i] if partial is None else partial + sums[i]
        for i, state in enumerate(states):
            if state.pooling_params.pooling_type == "CLS" and state.num_computed_tokens == 0:
                state.pooling_partial = hidden[int(starts[i])].float()

    def _vectors(self, states: list[CachedRequestState], starts: np.ndarray,
                 ending: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """[len(ending), H] float32: each ending request's pooled hidden state."""
        last_rows = torch.from_numpy(starts[np.asarray(ending) + 1].astype(np.int64) - 1)
        last = hidden[last_rows.to(self.device)].float()  # [F, H]
        types = [states[i].pooling_params.pooling_type for i in ending]
        if all(t == "LAST" for t in types):
            return last
        return torch.stack([
            last[j] if t == "LAST" else
            states[i].pooling_partial / (states[i].num_prompt_tokens if t == "MEAN" else 1)
            for j, (i, t) in enumerate(zip(ending, types, strict=True))])
