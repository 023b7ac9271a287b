"""Host-side inputs of one step: the ragged batch every scheduled token is flattened into.

    request      r0 (prefill chunk, 5 tokens)   r1 (decode)   r2 (decode)
    input_ids    [ a  b  c  d  e ]              [ f ]         [ g ]
    positions    [ 0  1  2  3  4 ]              [ 17 ]        [ 9 ]
    query_start_loc  0                           5             6          7
    seq_lens     5                              18            10
    slot_mapping block_table[r][pos // block_size] * block_size + pos % block_size

Each KV cache group has its own block table and slot mapping (docs/design.md §4): a request
holds different blocks in a full-attention group and in a sliding-window one. The step's block
tables come in already gathered, in batch order (`BlockTables.gather`, which keeps them between
steps). No padding anywhere: token t of the batch belongs to the request whose query range
holds t.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import compress, repeat
from operator import attrgetter, getitem, is_not

import numpy as np

from aserve.runner.request_state import CachedRequestState

# (what every request gives every step, read by C-level maps: no bytecode a request)
_COMPUTED = attrgetter("num_computed_tokens")
_TOKENS = attrgetter("all_token_ids")
_PROMPT_LOGPROBS = attrgetter("sampling_params.prompt_logprobs")


@dataclass
class PreparedInputs:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_tables: list[np.ndarray]  # per KV cache group: [num_reqs, max_num_blocks] int32
    slot_mappings: list[np.ndarray]  # per KV cache group: [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    # Rows of the batch that sample (their request reaches its last known token this step).
    sample_req_indices: list[int]
    # Hidden rows whose logits are computed, in one call: the last token of each sampling
    # request, then the rows of each prompt-logprobs span below.
    logits_indices: np.ndarray  # [num_sampling_reqs + sum of span lengths] int64
    # (request index, first prompt position, rows) per request asking for prompt logprobs: the
    # hidden row of position p predicts prompt token p + 1.
    prompt_logprob_spans: list[tuple[int, int, int]]
    # Speculative decoding: (request index, its drafts) per request verifying drafts; their
    # rows of logits come last in logits_indices, each request's k rows in order (row j
    # predicts draft j + 1; the row after the drafts is the request's sampling row).
    spec_drafts: list[tuple[int, list[int]]] = field(default_factory=list)

    def sampling_row_drafts(self) -> list[list[int]] | None:
        """Per sampling row, the drafts it comes after ([] for most); None without drafts."""
        if not self.spec_drafts:
            return None
        drafts = dict(self.spec_drafts)
        return [drafts.get(i, []) for i in self.sample_req_indices]


def prepare_inputs(states: list[CachedRequestState], num_scheduled: list[int],
                   block_tables: list[np.ndarray], block_size: int,
                   drafts: list[list[int]] | None = None,
                   prompt_logprobs: bool = True) -> PreparedInputs:
    """`block_tables`: per KV cache group, [len(states), max_num_blocks] int32, row i the
    block ids of `states[i]`, zero-padded. `drafts[i]`: the tokens request i's query runs on
    past its known ones (speculative decoding), or None. `prompt_logprobs`: whether any of
    them may ask for prompt logprobs (False: none is looked at for it)."""
    num_reqs = len(states)
    computed = list(map(_COMPUTED, states))  # (Python ints for the slicing below)
    token_lists = list(map(_TOKENS, states))
    num_computed = np.array(computed, dtype=np.int32)
    if sum(num_scheduled) == num_reqs:  # decode-only step: one token each (none has 0)
        query_lens = np.ones(num_reqs, dtype=np.int32)
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
        req_of_token = np.arange(num_reqs)
        input_ids = np.array(list(map(getitem, token_lists, computed)), dtype=np.int64)
        positions = num_computed.astype(np.int64)
    else:
        query_lens = np.asarray(num_scheduled, dtype=np.int32)  # [num_reqs]
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        input_ids = np.concatenate([
            np.asarray((t + d if d else t)[c:c + n], dtype=np.int64)
            for t, c, n, d in zip(token_lists, computed, num_scheduled,
                                  drafts or [None] * num_reqs)
        ])
        # position of each token = its request's computed count + its offset in the query
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        offsets = np.arange(len(input_ids)) - query_start_loc[req_of_token]
        positions = (num_computed[req_of_token] + offsets).astype(np.int64)
    seq_lens = num_computed + query_lens  # [num_reqs]

    slot_mappings = []
    for block_table in block_tables:
        block_ids = block_table[req_of_token, positions // block_size]
        slot_mappings.append(block_ids.astype(np.int64) * block_size + positions % block_size)

    # a request samples where its query reaches its last known token (and its drafts)
    num_known = np.fromiter(map(len, token_lists), dtype=np.int64, count=num_reqs)
    if drafts:
        num_known += np.fromiter(map(len, drafts), dtype=np.int64, count=num_reqs)
    sample_req_indices = np.flatnonzero(seq_lens == num_known).tolist()
    ends = query_start_loc[1:].astype(np.int64) - 1  # each request's last row
    rows = [ends if len(sample_req_indices) == num_reqs else ends[sample_req_indices]]
    spans = []
    asking = (compress(range(num_reqs), map(is_not, map(_PROMPT_LOGPROBS, states), repeat(None)))
              if prompt_logprobs else ())
    for i in asking:
        state, c, n = states[i], computed[i], num_scheduled[i]
        end = min(c + n, state.num_prompt_tokens - 1)
        if c < end:
            spans.append((i, c, end - c))
            rows.append(np.arange(query_start_loc[i], query_start_loc[i] + end - c))
    spec_drafts = [(i, d) for i, d in enumerate(drafts) if d] if drafts else []
    for i, d in spec_drafts:  # rows at the last known token and the drafts but the last
        last = query_start_loc[i + 1] - 1
        rows.append(np.arange(last - len(d), last))
    return PreparedInputs(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
        slot_mappings=slot_mappings,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        sample_req_indices=sample_req_indices,
        logits_indices=np.concatenate(rows).astype(np.int64),
        prompt_logprob_spans=spans,
        spec_drafts=spec_drafts,
    )


def token_bucket(num_tokens: int, smallest: int = 16) -> int:
    """The power of two (at least `smallest`) a batch of `num_tokens` is padded to."""
    return max(smallest, 1 << (num_tokens - 1).bit_length())


def pad_to_bucket(inputs: PreparedInputs) -> PreparedInputs:
    """The same batch with its token rows padded to `token_bucket` (static-shape backends such
    as XLA compile one graph per shape): padding tokens are id 0 at position 0 with slot -1,
    belong to no request, write no K/V and are never read back."""
    num_tokens = len(inputs.input_ids)
    pad = token_bucket(num_tokens) - num_tokens
    if pad == 0:
        return inputs
    return replace(inputs,
                   input_ids=np.pad(inputs.input_ids, (0, pad)),
                   positions=np.pad(inputs.positions, (0, pad)),
                   slot_mappings=[np.pad(m, (0, pad), constant_values=-1)
                                  for m in inputs.slot_mappings])
