"""`verify_drafts`: how many of each request's drafts the target accepts, and the token after
them, so that the tokens come out distributed exactly as without speculation.

A request with k drafts d_1..d_k has k + 1 rows of target logits: row j at the position
d_{j+1} was proposed for (after d_1..d_j), row k after them all (its token, the "bonus", the
runner's sampler draws as any row's). Going along the drafts, the first one rejected ends
the run, and the token in its place is drawn from the residual distribution:

    greedy (temperature 0)   accept d_j while d_j = argmax p_j; else the argmax
    random                   accept d_j with probability p_j(d_j); else draw from p_j with
                             d_j removed (renormalized)

p_j is the row's distribution after logit bias, the min_tokens mask, the penalties (with
d_1..d_j counted as output), temperature, min-p, top-k and top-p, as the sampler's. (The
scheduler keeps a request's drafts on one side of its min_tokens, so the rows of a step are
all masked or none, as the request's state says.)
The random rule is the rejection sampler of speculative sampling (Leviathan et al. 2023;
Chen et al. 2023) for a draft distribution q that is one-hot at d_j, as an n-gram draft's is:
accept with min(1, p(d) / q(d)) = p(d), else draw from max(0, p - q) / (1 - p(d)). The first
token is then d with probability p(d) and any other x with probability
(1 - p(d)) * p(x) / (1 - p(d)) = p(x): the target's distribution, whatever the draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aserve.runner.sampler import apply_logits_processors, filtered_probs, inverse_cdf
from aserve.runner.sampling_metadata import SamplingMetadata


def verify_drafts(logits: torch.Tensor, drafts: list[list[int]], bonus: list[int],
                  metadata: SamplingMetadata,
                  argmax: Callable[[torch.Tensor], torch.Tensor],
                  uniforms: Callable[[torch.Tensor, int], torch.Tensor],
                  ) -> list[tuple[int, int]]:
    """logits [sum of len(drafts[i]), V] float32: request i's draft rows, in order;
    `metadata` has one row per draft row (the request's parameters repeated); `bonus[i]`:
    the token request i's row after its drafts drew. `uniforms(probs, n)`: n float64 draws in
    [0, 1) on probs' device. Returns per request (drafts accepted, the token after them)."""
    device = logits.device
    logits = apply_logits_processors(logits, metadata)  # bias, min_tokens (no penalties here)
    flat = torch.tensor([d for ds in drafts for d in ds], dtype=torch.int64, device=device)
    rows = torch.arange(len(flat), device=device)
    if metadata.all_greedy:
        target = argmax(logits)  # [R]
        accepted, replacement = target == flat, target
    else:
        probs = filtered_probs(logits, metadata)  # [R, V]
        p_draft = probs[rows, flat]
        accept_draw = uniforms(probs, len(flat)).to(p_draft.dtype)
        accepted = accept_draw < p_draft  # p(d) = 1: always; p(d) = 0: never
        residual = probs.index_put_((rows, flat), torch.zeros((), device=device))
        replacement = inverse_cdf(residual, uniforms(residual, len(flat)))
        if not metadata.all_random:
            target = argmax(logits)
            greedy = metadata.temperature == 0
            accepted = torch.where(greedy, target == flat, accepted)
            replacement = torch.where(greedy, target, replacement)
    accepted_host = accepted.tolist()
    replacement_host = replacement.tolist()
    out, row = [], 0
    for ds, last in zip(drafts, bonus, strict=True):
        n = 0
        while n < len(ds) and accepted_host[row + n]:
            n += 1
        out.append((n, last if n == len(ds) else replacement_host[row + n]))
        row += len(ds)
    return out
