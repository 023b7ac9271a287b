"""The runner's side of llguidance: `GrammarMatcher` (one request's position in a compiled
grammar, `compiler.py`) and the token-bitmask ops (`fill_token_bitmask`; `apply_token_bitmask`,
a torch op: disallowed tokens' logits to -inf, on any device).

The token bitmask is int32 [rows, ceil(vocab / 32)], bit j of word w set where token 32 w + j
is allowed (llguidance's and xgrammar's layout). Tokens past the tokenizer's vocabulary (a
model's padded rows) are never allowed.

Why llguidance rather than xgrammar (vLLM's default): both compile and mask far within
a decode step (docs/benchmarks/structured-outputs.md), but xgrammar 0.2.9 lets a length-bounded
JSON string (`maxLength`) hold raw control characters, which is not JSON (`json.loads` refuses
it), and needs a private call to read a `tokenizers` vocabulary; llguidance's strings are
JSON's, it takes the tokenizer's JSON as it is, and it checks a grammar against the tokenizer
before use.
"""

from __future__ import annotations

from typing import Any

import torch

from aserve.structured_output.compiler import CompiledGrammar


class GrammarMatcher:
    """One request's state in its grammar: `fill_bitmask` before a token is sampled,
    `accept_token` after. Rebuilt (and replayed) when a preempted request resumes.

    llguidance's matcher is built on first use, not here: the runner creates request states in
    its step, and building a large schema's matcher takes milliseconds, which the first mask
    fill, run beside the forward, absorbs instead."""

    def __init__(self, compiled: CompiledGrammar, token_ids: list[int] = ()) -> None:
        self._compiled = compiled
        self._replay = list(token_ids)
        self._matcher: Any = None
        self._start_after = compiled.start_after_ids  # free until these tokens (reasoning)
        self._waiting = bool(self._start_after)
        self._tail: list[int] = []

    def _llmatcher(self) -> Any:
        if self._matcher is None:
            import llguidance

            self._matcher = llguidance.LLMatcher(self._compiled.tokenizer,
                                                 self._compiled.grammar)
            replay, self._replay = self._replay, []
            for token_id in replay:
                self.accept_token(token_id)
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False if the grammar does not allow it (or has ended)."""
        matcher = self._llmatcher()  # (first: the tokens to replay come before this one)
        if self._waiting:
            self._tail = (self._tail + [token_id])[-len(self._start_after):]
            self._waiting = self._tail != self._start_after
            return True
        if matcher.is_stopped():
            return False
        return matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (int32, CPU) := the tokens allowed next. A grammar that has
        ended (its text complete, nothing may follow) allows only the stop tokens: the request
        ends there with EOS. Before its start (a reasoning model still thinking) the row stays
        as it is: every token allowed."""
        matcher = self._llmatcher()
        if self._waiting:
            return
        if matcher.is_stopped():
            bitmask[row] = 0
            for token_id in self._compiled.tokenizer.eos_tokens:
                bitmask[row, token_id // 32] |= _bit(token_id % 32)
            return
        # llguidance writes the row through a raw pointer (llguidance.torch's wrapper of this
        # call would import torch._dynamo, a stall at the first constrained step)
        if not (bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
                and bitmask.dim() == 2 and bitmask.is_contiguous()):
            raise ValueError("a token bitmask is a contiguous int32 [rows, words] CPU tensor")
        matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), 4 * bitmask.shape[1])

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` may come next (what `fill_bitmask` would allow), without
        advancing: one token's check, far cheaper than a whole mask."""
        matcher = self._llmatcher()
        if self._waiting:
            return True
        if matcher.is_stopped():
            return token_id in self._compiled.tokenizer.eos_tokens
        return matcher.validate_tokens([token_id]) == 1

    @property
    def is_terminated(self) -> bool:
        return self._llmatcher().is_stopped()

    def fork(self) -> GrammarMatcher:
        """A copy at the same place, to advance along speculative drafts without moving
        this one (llguidance's `deep_copy`)."""
        copy = GrammarMatcher(self._compiled)
        copy._matcher = self._llmatcher().deep_copy()
        copy._waiting, copy._tail = self._waiting, list(self._tail)
        return copy


def fill_token_bitmask(matchers: list[GrammarMatcher], vocab_size: int,
                       held_stops: list[list[int]]) -> torch.Tensor:
    """The token bitmask of these matchers' next tokens, one row each, in order. Row r also
    blocks `held_stops[r]` (a request short of its `min_tokens`: its stop tokens), unless they
    are all its grammar allows: a grammar that has ended ends the request.

    Row by row in the calling thread: llguidance's batch executor (one call for all rows, on a
    thread pool) is slower on 2 cores, in the server and offline, its pool's threads competing
    with the forward's (docs/benchmarks/structured-outputs.md)."""
    bitmask = allocate_token_bitmask(len(matchers), vocab_size)  # [R, ceil(V / 32)]
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask, row)
    for row, stops in enumerate(held_stops):
        if stops:
            held = bitmask[row].clone()
            for token_id in stops:
                held[token_id // 32] &= ~_bit(token_id % 32)
            if held.any():
                bitmask[row] = held
    return bitmask


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int (bit 31 is the sign)."""
    return -(1 << 31) if j == 31 else 1 << j


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab / 32)] on the CPU, every token allowed."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


_BITS = torch.arange(32, dtype=torch.int32)
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] with disallowed tokens at -inf (a new tensor): bitmask [len(rows), W] for
    the rows `rows` (all rows when None). Plain torch ops. On the CPU and CUDA it works on the
    logits' bits with integer ops (a CPU runs a float masked_fill several times slower), so
    every value, NaN and -0.0 included, comes out as `apply_token_bitmask_ref` gives it; other
    devices (whose dtype views are not known here to work) run the reference."""
    if logits.device.type not in ("cpu", "cuda"):
        return apply_token_bitmask_ref(logits, bitmask, rows)
    if rows is None:
        return _masked(logits, bitmask)
    out = logits.clone()
    return out.index_copy_(0, rows, _masked(logits.index_select(0, rows), bitmask))


def _masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] as a new tensor, -inf where bitmask [R, W] does not allow the token:
    x ^ ((x ^ -inf) & blocked) is -inf where `blocked` has every bit set, x where it is 0."""
    int_type = _INT_OF_SIZE[logits.element_size()]
    mask = bitmask.to(logits.device)
    blocked = (mask[:, :, None] >> _BITS.to(logits.device)) & 1  # [R, W, 32]: 1 allowed
    blocked = blocked.sub_(1).view(len(mask), -1)[:, :logits.shape[-1]]  # [R, V]: 0 or -1
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype).view(int_type).item()
    bits = logits.view(int_type)
    out = bits ^ neg_inf
    out &= blocked.to(int_type)
    out ^= bits
    return out.view(logits.dtype)


def masked_argmax(logits: torch.Tensor, rows: torch.Tensor,
                  bitmask: torch.Tensor) -> torch.Tensor:
    """argmax over each row's allowed tokens (ties -> the lowest id, as `KernelOps.argmax`):
    for logits rows `rows` [R], the allowed tokens of bitmask [R, W]; int64 [R]. A row whose
    mask allows a handful of tokens (a JSON brace, a key) reads only the logits of the words
    that allow one, microseconds instead of a pass over the vocabulary; a row allowing much of
    it takes the masked copy and a plain argmax. A row allowing nothing gives token 0, as an
    argmax over -inf does."""
    device = logits.device
    mask, rows = bitmask.to(device), rows.to(device)
    words = mask != 0
    dense = 8 * words.sum(dim=1) > words.shape[1]  # [R]
    token = torch.empty(len(mask), dtype=torch.int64, device=device)
    for part, argmax in ((dense, _dense_argmax), (~dense, _sparse_argmax)):
        index = part.nonzero().flatten()
        if len(index):
            token[index] = argmax(logits, rows[index], mask[index])
    return token


def _dense_argmax(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(logits.index_select(0, rows), mask).argmax(dim=-1)


def _sparse_argmax(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vocab, device = logits.shape[-1], logits.device
    row, word = (mask != 0).nonzero(as_tuple=True)  # [M]: the words allowing a token
    tokens = word[:, None] * 32 + _BITS.to(device)  # [M, 32]
    allowed = ((mask[row, word][:, None] >> _BITS.to(device)) & 1).bool() & (tokens < vocab)
    values = logits[rows[row][:, None], tokens.clamp(max=vocab - 1)]  # [M, 32]
    values = values.masked_fill(~allowed, float("-inf"))
    row = row[:, None].expand_as(tokens).reshape(-1)
    best = torch.full((len(mask),), float("-inf"), dtype=values.dtype, device=device)
    best = best.scatter_reduce(0, row, values.reshape(-1), "amax")  # [R]
    ties = torch.where(allowed & (values == best[row].view_as(values)), tokens, vocab)
    token = torch.full((len(mask),), vocab, dtype=torch.int64, device=device)
    token = token.scatter_reduce(0, row, ties.reshape(-1), "amin")
    return token.masked_fill_(token == vocab, 0)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: torch.Tensor | None = None) -> torch.Tensor:
    """`apply_token_bitmask`'s reference twin: the bits unpacked to bools, a masked_fill."""
    vocab = logits.shape[-1]
    mask = bitmask.to(logits.device)
    allowed = (mask[:, :, None] >> _BITS.to(logits.device)) & 1  # [R, W, 32]
    allowed = allowed.reshape(mask.shape[0], -1)[:, :vocab].bool()  # [R, V]
    out = logits.clone()
    if rows is None:
        return out.masked_fill_(~allowed, float("-inf"))
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out
