"""Sampler and SamplingMetadata on CPU: every knob changes exactly what it should, logprobs come
from the raw logits, seeded draws ignore the batch, and draws follow softmax(logits / T) — all
of it under both ways of drawing a random row (`KernelOps.random_sampling`)."""

from __future__ import annotations

import pytest
import torch

from aserve.runner.request_state import CachedRequestState
from aserve.runner.sampler import (
    Sampler,
    apply_logits_processors,
    apply_top_k,
    apply_top_k_top_p,
    apply_top_k_top_p_candidates,
    compute_prompt_logprobs,
    filtered_probs,
    inverse_cdf,
)
from aserve.runner.sampling_metadata import SamplingMetadata
from aserve.sampling_params import SamplingParams

INF = float("inf")
SAMPLER = {}  # how every Sampler below draws and filters (set per test by the fixture)


@pytest.fixture(autouse=True, params=[("race", 0), ("inverse_cdf", 0), ("inverse_cdf", 2)],
                ids=["race", "inverse_cdf", "inverse_cdf-2-candidates"])
def sampler_kind(request):
    SAMPLER.update(random_sampling=request.param[0], top_p_candidates=request.param[1])
    return request.param


def state(prompt=(1, 2, 3), output=(), req_id="r", eos_token_ids=(), **params
          ) -> CachedRequestState:
    """A running request's state; `eos_token_ids` are the engine's (stop unless ignore_eos)."""
    sampling_params = SamplingParams(**params)
    stop_ids = set(sampling_params.stop_token_ids)
    if not sampling_params.ignore_eos:
        stop_ids.update(eos_token_ids)
    return CachedRequestState(req_id=req_id, prompt_token_ids=list(prompt),
                              sampling_params=sampling_params,
                              num_computed_tokens=len(prompt), output_token_ids=list(output),
                              stop_token_ids=frozenset(stop_ids))


def build(states, vocab_size) -> SamplingMetadata:
    return SamplingMetadata.build(states, vocab_size, "cpu")


def sample(logits, states, seed=0):
    sampler = Sampler(generator=torch.Generator().manual_seed(seed), **SAMPLER)
    return sampler(logits, build(states, logits.shape[1]))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = torch.randn(8, 50)
    logits[0] = torch.tensor([1.0, 3.0, 3.0, 0.0] + [-1.0] * 46)
    out = sample(logits, [state(temperature=0.0) for _ in range(8)])
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.sampled_token_ids[0].item() == 1
    assert out.logprobs is None


def test_unused_features_build_to_none():
    md = build([state(temperature=0.0), state(temperature=0.8)], 10)
    assert not md.all_greedy and not md.all_random
    unused = [md.top_k, md.top_p, md.min_p, md.presence_penalties, md.frequency_penalties,
              md.repetition_penalties, md.output_token_ids, md.all_token_ids, md.logit_bias,
              md.min_tokens_mask, md.max_num_logprobs]
    assert all(x is None for x in unused) and md.seeded_rows == []
    assert build([state(temperature=0.0)], 10).all_greedy
    assert build([state(temperature=1.0)], 10).all_random


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(16, 100)
    states = [state(temperature=0.0 if i % 2 else 1.0, seed=i if i % 4 == 0 else None)
              for i in range(16)]
    out = sample(logits, states).sampled_token_ids
    assert out[1::2].tolist() == logits[1::2].argmax(dim=-1).tolist()


def test_vanishing_temperature_is_greedy():
    logits = torch.randn(32, 100) * 3
    assert build([state(temperature=1e-6)], 100).all_greedy
    out = sample(logits, [state(temperature=1e-3) for _ in range(32)])
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_tightest_filter_equals_greedy(params):
    logits = torch.randn(64, 200)
    out = sample(logits, [state(temperature=1.5, **params) for _ in range(64)])
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("params, support", [
    (dict(top_k=2), [0, 1]), (dict(top_k=3), [0, 1, 2]),
    (dict(top_p=0.75), [0, 1]), (dict(top_p=0.85), [0, 1, 2]), (dict(top_p=0.4), [0]),
    (dict(min_p=0.2), [0, 1, 2]), (dict(min_p=0.5), [0, 1]),
    (dict(top_k=2, top_p=0.9), [0, 1]),
])
def test_filters_keep_the_right_tokens_and_renormalise(params, support):
    md = build([state(**params)], 4)
    probs = filtered_probs(PROBS.log()[None], md)[0]
    assert (probs > 0).nonzero().flatten().tolist() == support
    kept = PROBS[support] / PROBS[support].sum()
    torch.testing.assert_close(probs[support], kept)


def test_repetition_penalty_divides_positive_multiplies_negative_on_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    states = [state(prompt=[0], output=[1, 9], repetition_penalty=2.0), state(prompt=[0])]
    got = apply_logits_processors(logits, build(states, 5))
    assert got[0].tolist() == [1.0, -4.0, 1.0, -1.0, 0.5]  # id 9 is out of vocab: ignored
    assert got[1].tolist() == logits[1].tolist()


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(2, 5)
    states = [state(prompt=[0, 0], output=[2, 2, 3], frequency_penalty=0.5, presence_penalty=1.0),
              state(prompt=[0], output=[2])]
    got = apply_logits_processors(logits, build(states, 5))
    assert got[0].tolist() == [0.0, 0.0, -2.0, -1.5, 0.0]
    assert got[1].tolist() == [0.0] * 5


def test_logit_bias_forces_a_token_and_ignores_out_of_vocab_ids():
    logits = torch.randn(4, 30)
    states = [state(temperature=t, logit_bias={7: 100.0, 31: 5.0, -1: 5.0}) for t in (0, 1, 0, 1)]
    assert sample(logits, states).sampled_token_ids.tolist() == [7] * 4


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 8.0]])
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[2], eos_token_ids=(4,))
    early = sample(logits, [state(output=[1], **params)]).sampled_token_ids
    assert early.tolist() == [3]
    reached = sample(logits, [state(output=[1, 1], **params)]).sampled_token_ids
    assert reached.tolist() == [2]
    no_eos = dict(params, stop_token_ids=[], ignore_eos=True)
    assert sample(logits, [state(output=[1], **no_eos)]).sampled_token_ids.tolist() == [2]


def test_params_cache_keeps_parameter_tensors_and_rebuilds_what_follows_the_tokens():
    """While the same SamplingParams objects come in the same order, their tensors are reused;
    the min_tokens mask, the penalties' token lists and the seeded rows' seeds still follow
    each step's tokens, and another batch (even with equal values) builds its own."""
    from aserve.runner.sampling_metadata import SamplingParamsCache

    cache = SamplingParamsCache()
    a = state(output=[1], temperature=0.0, min_tokens=2, stop_token_ids=[2],
              presence_penalty=1.0)
    b = state(output=[3], temperature=1.0, seed=5, top_k=3)
    first = SamplingMetadata.build([a, b], 5, "cpu", cache=cache)
    assert first.min_tokens_mask[0].tolist() == [0] and first.min_tokens_mask[1].tolist() == [2]
    assert first.output_token_ids.tolist() == [[1], [3]]
    a.append_output_token_id(4)
    b.append_output_token_id(0)
    second = SamplingMetadata.build([a, b], 5, "cpu", cache=cache)
    assert second.temperature is first.temperature and second.top_k is first.top_k
    assert second.min_tokens_mask is None  # a has reached min_tokens
    assert second.output_token_ids.tolist() == [[1, 4], [3, 0]]
    assert second.seeded_generator_seeds != first.seeded_generator_seeds  # position 1, not 0
    assert second.seeded_generator_seeds == build([a, b], 5).seeded_generator_seeds
    swapped = SamplingMetadata.build([b, a], 5, "cpu", cache=cache)
    assert swapped.temperature.tolist() == [1.0, 0.0] and swapped.seeded_rows == [0]
    twin = state(output=[1, 4], temperature=0.0, min_tokens=2, stop_token_ids=[2],
                 presence_penalty=1.0)  # equal values, another request
    other = SamplingMetadata.build([twin, a], 5, "cpu", cache=cache)
    assert other.temperature is not swapped.temperature
    assert other.temperature.tolist() == [0.0, 0.0] and other.seeded_rows == []


def test_logprobs_come_from_raw_logits_with_correct_ranks():
    logits = torch.randn(3, 40)
    worst = int(logits[1].argmin())
    states = [state(temperature=0.0, logprobs=3),
              state(temperature=0.7, logprobs=2, logit_bias={worst: 1e4}),
              state(temperature=0.0, repetition_penalty=1.5)]
    original = logits.clone()
    out = sample(logits, states)
    assert torch.equal(logits, original)  # input untouched
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4)
    sampled = out.sampled_token_ids
    assert sampled[1].item() == worst
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert lp.ranks[0].item() == 1 and lp.ranks[1].item() == 40
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)


def test_tolists_picks_rows_and_trims_columns():
    logits = torch.randn(3, 40)
    out = sample(logits, [state(temperature=0.0, logprobs=k) for k in (3, 0, 1)])
    raw = torch.log_softmax(logits, dim=-1)
    top = raw.topk(3, dim=-1)
    row2, row0 = out.logprobs.tolists(rows=[2, 0], num_logprobs=[1, 3])
    assert row2.token_ids == [[top.indices[2, 0].item()] * 2] and row2.ranks == [1]
    assert row0.token_ids == [[top.indices[0, 0].item()] + top.indices[0].tolist()]
    assert row0.logprobs == [pytest.approx([top.values[0, 0].item()] + top.values[0].tolist())]
    merged = out.logprobs.tolists(merge=True)
    assert [len(t) for t in merged.token_ids] == [4, 4, 4] and merged.ranks == [1, 1, 1]


def test_prompt_logprobs_put_the_actual_next_token_first():
    logits = torch.randn(5, 20)
    targets = torch.tensor([3, 0, 19, 7, 7])
    lp = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert lp.token_ids[:, 0].tolist() == targets.tolist()
    torch.testing.assert_close(lp.logprobs[:, 0], raw[torch.arange(5), targets])
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(2).indices)
    assert torch.equal(lp.ranks, (raw > raw[torch.arange(5), targets][:, None]).sum(-1) + 1)


def test_seeded_draw_ignores_batch_row_and_global_rng():
    vocab = 1000
    mine = torch.randn(vocab)
    alone = sample(mine[None], [state(output=[5] * 7, seed=1234)], seed=0).sampled_token_ids
    for trial, row in enumerate((0, 9, 15)):
        torch.manual_seed(trial)
        logits = torch.randn(16, vocab)
        logits[row] = mine
        states = [state(temperature=[0.0, 1.0][i % 2], seed=(i if i % 3 == 0 else None),
                        output=[1] * i) for i in range(16)]
        states[row] = state(prompt=[9] * trial, output=[6] * 7, seed=1234)
        batch = sample(logits, states, seed=100 + trial).sampled_token_ids
        assert batch[row].item() == alone.item()


def test_unseeded_rows_use_the_generator_given_to_build():
    logits = torch.zeros(8, 1000)
    states = [state() for _ in range(8)]

    def draw(seed):
        generator = torch.Generator().manual_seed(seed)
        md = SamplingMetadata.build(states, 1000, "cpu", generator=generator)
        return Sampler(**SAMPLER)(logits, md).sampled_token_ids.tolist()

    assert draw(1) == draw(1) != draw(2)


def test_seeded_draws_differ_across_positions_and_seeds():
    logits = torch.zeros(1, 1000)
    by_position = {sample(logits, [state(output=[0] * k, seed=7)]).sampled_token_ids.item()
                   for k in range(20)}
    by_seed = {sample(logits, [state(output=[0] * 3, seed=s)]).sampled_token_ids.item()
               for s in range(20)}
    assert len(by_position) >= 18 and len(by_seed) >= 18


# Chi-square critical value for 5 degrees of freedom at p = 1e-4 is 25.7; seeds are fixed, so
# these are deterministic checks of the distribution, not flaky ones.
@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_softmax_of_scaled_logits(seeded):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature, num_draws = 0.7, 6000
    states = [state(temperature=temperature, seed=i if seeded else None) for i in range(num_draws)]
    tokens = sample(logits.expand(num_draws, -1), states, seed=3).sampled_token_ids
    assert chi_square(tokens, torch.softmax(logits / temperature, dim=-1)) < 25.7


def test_top_p_draws_follow_the_renormalised_nucleus():
    logits = PROBS.log()
    num_draws = 6000
    states = [state(temperature=1.0, top_p=0.85) for _ in range(num_draws)]
    tokens = sample(logits.expand(num_draws, -1), states, seed=5).sampled_token_ids
    assert (tokens != 3).all()
    kept = PROBS[:3] / PROBS[:3].sum()
    assert chi_square(tokens, kept) < 21.0  # 2 degrees of freedom, p = 1e-4 is 18.4


def test_a_top_p_too_small_for_float32_still_keeps_the_best_token():
    from aserve.runner.sampler import apply_top_k_top_p

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    kept = apply_top_k_top_p(logits, None, torch.tensor([5e-324]).float())  # 0.0 in float32
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]


def test_inverse_cdf_never_draws_a_token_of_probability_zero():
    """Tokens of probability 0 (filtered out, or padded vocabulary rows) are never drawn, even
    by the extreme uniforms: 0 draws the first token with probability, the largest below 1
    the last one."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                          [0.3, 0.0, 0.7, 0.0, 0.0, 0.0]])
    for u, expected in ((0.0, [1, 5, 0]), (1 - 2**-53, [3, 5, 2]), (0.5, [3, 5, 2]),
                        (0.49, [1, 5, 2])):
        uniforms = torch.full((3,), u, dtype=torch.float64)
        assert inverse_cdf(probs, uniforms).tolist() == expected, u
    with pytest.raises(ValueError, match="race or inverse_cdf"):
        Sampler(random_sampling="gumbel")


def make_logits(kind: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "peaked":
        return torch.randn(8, vocab, generator=gen) * 5
    if kind == "flat":
        return torch.randn(8, vocab, generator=gen) * 0.1
    if kind == "ties":
        return torch.randint(-2, 3, (8, vocab), generator=gen).float()
    return torch.randn(8, vocab, generator=gen).masked_fill(  # masked
        torch.rand(8, vocab, generator=gen) < 0.5, -INF)


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_top_p_among_candidates_keeps_what_the_whole_sort_keeps(kind):
    """The candidate path keeps the same logits per row as sorting the whole vocabulary (which
    of several equal logits at the nucleus' edge may differ: both orders are arbitrary), for
    rows within the candidates and rows sorted whole; top_k alone through a top-k selection
    keeps exactly what a sort keeps."""
    gen = torch.Generator().manual_seed(len(kind))
    for trial in range(40):
        vocab = int(torch.randint(2, 2000, (1,), generator=gen))
        logits = make_logits(kind, vocab, gen)
        logits[:, 0] = 0.0  # (a finite logit in every row)
        top_k = torch.randint(1, vocab + 1, (8,), generator=gen)
        top_k[torch.rand(8, generator=gen) < 0.3] = vocab  # off
        top_p = torch.rand(8, generator=gen)
        top_p[torch.rand(8, generator=gen) < 0.3] = 1.0  # off
        k = int(torch.randint(1, 300, (1,), generator=gen))
        for row_top_k in (None, top_k):
            expected = apply_top_k_top_p(logits, row_top_k, top_p)
            got = apply_top_k_top_p_candidates(logits, row_top_k, top_p, k)
            for want, have in zip(expected, got, strict=True):
                assert torch.equal(want[want.isfinite()].sort().values,
                                   have[have.isfinite()].sort().values), (trial, k)
        on = top_k < vocab
        max_top_k = int(top_k[on].max()) if on.any() else None
        assert torch.equal(apply_top_k(logits, top_k, max_top_k), apply_top_k(logits, top_k))


def test_top_p_sorts_only_the_rows_whose_nucleus_is_not_among_the_candidates(monkeypatch):
    """A peaked row (its 16 best tokens hold the mass) or a row whose top_k is within the
    candidates is never sorted whole; a flat row under top_p alone is."""
    from aserve.runner import sampler

    sorted_rows = []
    whole_sort = sampler.apply_top_k_top_p
    monkeypatch.setattr(sampler, "apply_top_k_top_p",
                        lambda logits, *a: sorted_rows.append(len(logits))
                        or whole_sort(logits, *a))
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)) * 0.1  # flat
    logits[0, :8] = 30.0  # peaked
    top_k = torch.tensor([5000, 12, 5000])  # (5000: off)
    apply_top_k_top_p_candidates(logits, top_k, torch.tensor([0.9, 0.9, 0.9]), 16)
    assert sorted_rows == [1]  # the third row only


@pytest.mark.parametrize("block", [1, 7, 256])
def test_inverse_cdf_in_blocks_draws_what_one_whole_cumulative_sum_draws(block):
    gen = torch.Generator().manual_seed(block)
    for _ in range(50):
        vocab = int(torch.randint(1, 2000, (1,), generator=gen))
        logits = torch.randn(6, vocab, generator=gen) * 3
        logits[torch.rand(6, vocab, generator=gen) < 0.7] = -INF
        logits[:, int(torch.randint(0, vocab, (1,), generator=gen))] = 0.0
        probs = logits.softmax(dim=-1)
        uniforms = torch.rand(6, generator=gen, dtype=torch.float64)
        uniforms[:2] = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        target = torch.minimum(uniforms * cdf[:, -1],
                               torch.nextafter(cdf[:, -1], torch.zeros(6, dtype=torch.float64)))
        expected = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
        assert torch.equal(inverse_cdf(probs, uniforms, block), expected)
