"""The draft verifier (`spec_decode/verify.py`): greedy is argmax match; random keeps the
target's distribution exactly, whatever the draft (a statistical test on a small vocabulary)."""

from __future__ import annotations

import pytest
import torch

from aserve.backends.ops import argmax_ref
from aserve.runner.request_state import CachedRequestState
from aserve.runner.sampler import Sampler, filtered_probs
from aserve.runner.sampling_metadata import SamplingMetadata
from aserve.runner.spec_verify import verify_drafts
from aserve.sampling_params import SamplingParams

VOCAB = 8


def metadata_for(params: list[SamplingParams], generator: torch.Generator
                 ) -> SamplingMetadata:
    states = [CachedRequestState(str(i), [1], p, 0) for i, p in enumerate(params)]
    return SamplingMetadata.build(states, VOCAB, "cpu", generator=generator)


def run(logits: torch.Tensor, drafts: list[list[int]], bonus: list[int],
        params: list[SamplingParams], seed: int = 0) -> list[tuple[int, int]]:
    generator = torch.Generator().manual_seed(seed)
    sampler = Sampler(generator)
    rows = [p for p, ds in zip(params, drafts, strict=True) for _ in ds]
    metadata = metadata_for(rows, generator)
    return verify_drafts(logits, drafts, bonus, metadata, argmax_ref,
                         lambda probs, n: sampler.uniforms(probs, metadata, n))


def test_greedy_accepts_the_argmax_run_and_replaces_the_first_miss() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 2] = logits[3, 7] = 4.0
    greedy = SamplingParams(temperature=0.0)
    # request 0: drafts 3, 5 both right -> 2 accepted, the bonus follows
    # request 1: drafts 1 (argmax 2), 7 -> none accepted, 2 in its place
    out = run(logits, [[3, 5], [1, 7]], [6, 6], [greedy, greedy])
    assert out == [(2, 6), (0, 2)]


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat.double() / 2))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
], ids=["plain", "top_k", "top_p_min_p"])
@pytest.mark.parametrize("draft", [0, 5], ids=["likely_draft", "unlikely_draft"])
def test_random_verification_keeps_the_target_distribution(params: SamplingParams,
                                                          draft: int) -> None:
    draws = 20_000
    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0, 0.0, -0.5, 1.0, 0.2]])
    target = filtered_probs(logits, metadata_for([params], torch.Generator()))[0]
    out = run(logits.expand(draws, VOCAB).contiguous(), [[draft]] * draws, [-1] * draws,
              [params] * draws, seed=draft)
    first = torch.tensor([draft if n == 1 else token for n, token in out])
    counts = torch.bincount(first, minlength=VOCAB).double()
    assert counts.sum() == draws
    assert counts[target == 0].sum() == 0  # filtered-out tokens never come out
    tv = 0.5 * (counts / draws - target.double()).abs().sum()
    assert tv < 0.02, (tv, counts / draws, target)
    assert chi_square_p_value(counts, draws * target.double()) > 1e-3
    # the draft changes what was drawn (it is accepted with probability p(draft))
    accepted = sum(n for n, _ in out) / draws
    assert abs(accepted - float(target[draft])) < 0.02


def test_a_rejected_draft_is_never_its_own_replacement() -> None:
    draws = 4_000
    logits = torch.zeros(draws, VOCAB)
    out = run(logits, [[2]] * draws, [-1] * draws, [SamplingParams(temperature=1.0)] * draws)
    assert all(token != 2 for n, token in out if n == 0)
    assert 0.08 < sum(n for n, _ in out) / draws < 0.17  # p(2) = 1/8
