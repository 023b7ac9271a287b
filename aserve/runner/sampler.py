"""`Sampler`: logits of the sampling positions → one token per row (+ logprobs), vLLM V1 order.

    raw logits ──► logprobs (log_softmax of the RAW logits, when asked)
        │
        ├─ logit_bias ─ min_tokens mask ─ repetition ─ frequency/presence penalties
        │
        ├─ greedy rows: argmax (ties → lowest id, like HF)
        └─ random rows: ÷ temperature ─ min_p ─ top_k ─ top_p ─ softmax ─ a draw

The draw is the platform's (`KernelOps.random_sampling`): the exponential race (argmax of
probs / Exponential(1) noise, Gumbel-max sampling; V draws a row, elementwise, as vLLM does on
GPUs) or the inverse CDF (one uniform a row, the first token whose float64 cumulative
probability passes it: the CPU's, where V exponentials a row are slow to draw;
docs/benchmarks/sampling.md). Either way a seeded row draws from its own generator, seeded by
(seed, output position) only, so its tokens never depend on the batch around it. Nothing
here syncs with the host; only seeded rows and sparse per-row data loop in Python. This module
does not decide which rows sample (the runner does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aserve.backends.ops import argmax_ref
from aserve.core.outputs import LogprobsLists
from aserve.runner.sampling_metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Column 0 is the chosen token (sampled, or the actual next prompt token); columns 1..k are
    the top-k by logprob, best first. `ranks[i]` = 1 + #tokens with a strictly greater logprob."""

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64

    def tolists(self, rows: Sequence[int] | None = None,
                num_logprobs: Sequence[int] | None = None,
                merge: bool = False) -> list[LogprobsLists] | LogprobsLists:
        """Rows `rows` (all by default), in one host transfer: one one-row `LogprobsLists` per
        row, or with `merge` a single `LogprobsLists` holding them all. `num_logprobs[j]`, when
        given, keeps only column 0 and the top-`num_logprobs[j]` columns of the j-th row."""
        token_ids, logprobs, ranks = self.token_ids, self.logprobs, self.ranks
        if rows is not None:
            index = torch.tensor(list(rows), dtype=torch.int64).to(token_ids.device)
            token_ids, logprobs, ranks = token_ids[index], logprobs[index], ranks[index]
        # float64 holds int64 ids/ranks < 2**53 and float32 logprobs exactly: one copy for all.
        packed = torch.cat([token_ids.double(), logprobs.double(), ranks.double()[:, None]], 1)
        width = token_ids.shape[1]
        host = packed.cpu().tolist()
        keep = [width] * len(host) if num_logprobs is None else [k + 1 for k in num_logprobs]
        token_ids = [[int(t) for t in r[:n]] for r, n in zip(host, keep, strict=True)]
        logprobs = [r[width:width + n] for r, n in zip(host, keep, strict=True)]
        ranks = [int(r[-1]) for r in host]
        if merge:
            return LogprobsLists(token_ids, logprobs, ranks)
        return [LogprobsLists([t], [lp], [r])
                for t, lp, r in zip(token_ids, logprobs, ranks, strict=True)]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # k = metadata.max_num_logprobs


class Sampler(torch.nn.Module):
    """Samples one token per row. Unseeded random rows share `metadata.generator`, else
    `self.generator`, else the global RNG; seeded rows get a fresh generator per step from
    `metadata.seeded_generator_seeds`. The input logits are not modified. `argmax` is the
    platform's (`KernelOps.argmax`: ties -> the lowest id, like HF)."""

    def __init__(self, generator: torch.Generator | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_ref,
                 random_sampling: str = "race", top_p_candidates: int = 0) -> None:
        super().__init__()
        if random_sampling not in ("race", "inverse_cdf"):
            raise ValueError(f"random_sampling {random_sampling!r}: race or inverse_cdf")
        self.generator = generator
        self.argmax = argmax
        self.random_sampling = random_sampling
        self.top_p_candidates = top_p_candidates

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [N, V] float32
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [N, V]
        logits = apply_logits_processors(logits, metadata)
        sampled = self.sample(logits, metadata)  # [N]
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled,
                                                      metadata.max_num_logprobs))

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return self.argmax(logits)  # [N]
        greedy = None if metadata.all_random else self.argmax(logits)  # [N]
        probs = filtered_probs(logits, metadata, self.top_p_candidates)  # [N, V]
        if self.random_sampling == "inverse_cdf":
            random = inverse_cdf(probs, self._draws(probs, metadata, (len(probs),),
                                                    torch.float64, torch.Tensor.uniform_))
        else:
            noise = self._draws(probs, metadata, probs.shape, probs.dtype,
                                torch.Tensor.exponential_)  # [N, V]
            # A zero draw would turn a filtered-out token (prob 0) into 0/0 = nan, which
            # argmax picks.
            random = probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        if greedy is None:
            return random
        return torch.where(metadata.temperature == 0, greedy, random)

    def uniforms(self, probs: torch.Tensor, metadata: SamplingMetadata, n: int) -> torch.Tensor:
        """n float64 draws in [0, 1) on probs' device, from the generators rows draw from (for
        the verification of drafts: `spec_decode/verify.py`)."""
        return self._draws(probs, metadata, (n,), torch.float64, torch.Tensor.uniform_)

    def _draws(self, probs: torch.Tensor, metadata: SamplingMetadata, shape: tuple[int, ...],
               dtype: torch.dtype, fill: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Random draws of `shape` (a row per sampled row), `fill`ed (`Tensor.uniform_`,
        `Tensor.exponential_`) where the generator lives (the host on XLA, which has no device
        generators) and moved to the logits' device; a seeded row from a fresh generator."""
        shared = self.generator if metadata.generator is None else metadata.generator
        device = probs.device if shared is None else shared.device
        draws = torch.empty(shape, dtype=dtype, device=device)
        if len(metadata.seeded_rows) < shape[0]:
            fill(draws, generator=shared)
        for row, seed in zip(metadata.seeded_rows, metadata.seeded_generator_seeds, strict=True):
            generator = torch.Generator(device=device).manual_seed(seed)
            fill(draws[row], generator=generator)
        return draws.to(probs.device)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = 256) -> torch.Tensor:
    """probs [N, V] (rows summing to ~1), uniforms float64 [N] in [0, 1) -> int64 [N]: the
    first token whose cumulative probability exceeds uniform x the row's total.

    In two levels, so that no [N, V] cumulative sum is written (a fresh 8-byte [N, V] buffer a
    step, 12.6 MB at 32 x 49k, cost more in page faults than the scan): float64 sums of blocks
    of `block` tokens, the block the target falls in, then the cumulative sum within it.
    float64 keeps every token's share exact to ~1e-16 (float32 over 150 k tokens drifts by
    ~1e-5); a token of probability 0 never passes (its cumulative sum equals its
    predecessor's), and the target is kept below the total so that rounding cannot pass the
    last token that has probability."""
    num_rows, vocab = probs.shape
    whole = vocab - vocab % block
    sums = probs[:, :whole].view(num_rows, -1, block).sum(dim=-1, dtype=torch.float64)
    if whole < vocab:  # the last, shorter block
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True, dtype=torch.float64)],
                         dim=1)
    ends = sums.cumsum(dim=-1)  # [N, num_blocks]: cumulative probability at each block's end
    total = ends[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    j = torch.searchsorted(ends, target[:, None], right=True)  # [N, 1]: the block
    j = j.clamp_max_(ends.shape[1] - 1)  # (a row of nan)
    before = torch.where(j > 0, ends.gather(1, (j - 1).clamp_min(0)), 0.0)  # [N, 1]
    columns = j * block + torch.arange(block, device=probs.device)  # [N, block]
    inside = probs.gather(1, columns.clamp_max(vocab - 1)).masked_fill(columns >= vocab, 0.0)
    within = before + inside.cumsum(dim=-1, dtype=torch.float64)  # [N, block]
    offset = torch.searchsorted(within, target[:, None], right=True).clamp_max_(block - 1)
    return (j * block + offset)[:, 0].clamp_max_(vocab - 1)


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens, then penalties; returns a new tensor if anything applies."""
    if metadata.logit_bias is not None:
        rows, ids, values = metadata.logit_bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if metadata.min_tokens_mask is not None:
        rows, ids = metadata.min_tokens_mask
        logits = logits.index_put((rows, ids), logits.new_tensor(float("-inf")))
    if metadata.repetition_penalties is not None:
        logits = apply_repetition_penalty(logits, metadata.all_token_ids,
                                          metadata.repetition_penalties)
    if metadata.presence_penalties is not None or metadata.frequency_penalties is not None:
        logits = apply_frequency_presence(logits, metadata.output_token_ids,
                                          metadata.frequency_penalties,
                                          metadata.presence_penalties)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, token_ids: torch.Tensor,
                             penalties: torch.Tensor) -> torch.Tensor:
    """HF/vLLM: over tokens seen in prompt or output, divide positive logits by the penalty and
    multiply negative ones. `token_ids` [N, L] is padded with V."""
    num_rows, vocab_size = logits.shape
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen = seen.scatter_(1, token_ids, True)[:, :vocab_size]  # [N, V]
    penalty = penalties[:, None]  # [N, 1]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence(logits: torch.Tensor, token_ids: torch.Tensor,
                             frequency: torch.Tensor | None,
                             presence: torch.Tensor | None) -> torch.Tensor:
    """OpenAI: logits -= frequency * count + presence * (count > 0), counts over OUTPUT tokens.
    `token_ids` [N, L] is padded with V."""
    num_rows, vocab_size = logits.shape
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts = counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]  # [N, V]
    if frequency is not None:
        logits = logits - frequency[:, None] * counts
    if presence is not None:
        logits = logits - presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, metadata: SamplingMetadata,
                   top_p_candidates: int = 0) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p → probabilities [N, V] (a fresh tensor). Greedy rows
    are scaled by 1 instead of 0; their result is discarded. `top_p_candidates` > 0: top_p
    looks among each row's best that many tokens first (`apply_top_k_top_p_candidates`)."""
    temperature = metadata.temperature
    if not metadata.all_random:
        temperature = torch.where(temperature == 0, 1.0, temperature)
    logits = logits / temperature[:, None]  # [N, V]
    if metadata.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * metadata.min_p[:, None]  # [N, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if metadata.top_p is not None and top_p_candidates:
        logits = apply_top_k_top_p_candidates(logits, metadata.top_k, metadata.top_p,
                                              max(top_p_candidates, metadata.max_top_k or 0))
    elif metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    elif metadata.top_k is not None:
        logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
    return logits.softmax(dim=-1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor,
                max_top_k: int | None = None) -> torch.Tensor:
    """Keep tokens whose logit is >= the k-th largest (ties at the k-th are kept, as in HF).
    The k-th comes from a top-`max_top_k` selection (all rows' largest k, known on the host),
    not a sort of the whole vocabulary, which costs a CPU many times more
    (docs/benchmarks/sampling.md)."""
    vocab = logits.shape[-1]
    if max_top_k is None or 4 * max_top_k > vocab:
        best = logits.sort(dim=-1, descending=True).values  # [N, V]
    else:
        best = logits.topk(max_top_k, dim=-1).values  # [N, max_top_k], best first
    kth = best.gather(1, (top_k.clamp(max=best.shape[-1]) - 1)[:, None])  # [N, 1]
    kth = torch.where(top_k[:, None] >= vocab, float("-inf"), kth)  # (rows without top_k)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor) -> torch.Tensor:
    """top_k, then top_p: keep the smallest best-first set whose probability mass reaches top_p
    (the best token always stays). One sort serves both."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V] each
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [N, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [N, V]; mass of strictly better tokens
    top_p = top_p[:, None]  # [N, 1]; rows at 1 stay exact despite cumsum rounding
    drop = (mass_before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False  # the best token always stays, however small top_p (even 0.0 in fp32)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor | None,
                                 top_p: torch.Tensor, k: int) -> torch.Tensor:
    """`apply_top_k_top_p` without sorting the vocabulary: the nucleus of each row is looked
    for among its k best tokens (`topk`, best first), where it lies whenever they hold top_p of
    the row's probability (a trained model's distribution nearly always: its top 256 tokens
    hold most of the mass), or the row's top_k is within them; a row where it does not (a flat
    distribution, or a tie at the k-th token that may continue past it) is sorted whole, as
    before. Rows without top_k and top_p stay as they are. Deciding which rows to sort reads
    the device, which on the CPU costs nothing."""
    num_rows, vocab = logits.shape
    k = min(k, vocab)
    values, order = logits.topk(k, dim=-1)  # [N, k] each, best first
    no_top_k = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
    within = torch.zeros_like(no_top_k)  # rows whose top_k tokens are all candidates
    if top_k is not None:
        no_top_k = top_k >= vocab
        kth = values.gather(1, (top_k.clamp(max=k) - 1)[:, None])  # [N, 1]
        within = (top_k <= k) & ((values[:, -1] < kth[:, 0]) | (k == vocab))
        values = torch.where(within[:, None] & (values < kth), float("-inf"), values)
    # probabilities over the row's tokens after top_k: within the candidates, or the whole row
    norm = torch.where(within, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))  # [N]
    probs = (values - norm[:, None]).exp()  # [N, k]
    cumulative = probs.cumsum(dim=-1)
    p = top_p[:, None]  # [N, 1]
    drop = (cumulative - probs >= p) & (p < 1.0)  # mass of strictly better tokens >= top_p
    drop[:, 0] = False  # the best token always stays
    values = values.masked_fill(drop, float("-inf"))
    unfiltered = no_top_k & (top_p >= 1.0)
    resolved = within | (~unfiltered & no_top_k & (cumulative[:, -1] >= top_p))
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, values)
    out = torch.where(unfiltered[:, None], logits, out)
    rest = (~resolved & ~unfiltered).nonzero().flatten()
    if len(rest):
        out[rest] = apply_top_k_top_p(logits[rest], None if top_k is None else top_k[rest],
                                      top_p[rest])
    return out


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_logprobs: int) -> LogprobsTensors:
    """logprobs [N, V], chosen token_ids [N] → the chosen token, its rank, and the top-k."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k] each
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids[:, None], top_ids], dim=1),
        logprobs=torch.cat([chosen, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs: logits [M, V] at prompt positions, target_token_ids [M] = the actual next
    prompt token of each position (column 0 of the result)."""
    return gather_logprobs(logits.log_softmax(dim=-1), target_token_ids, num_logprobs)
