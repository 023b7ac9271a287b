"""StepCostModel: the least-squares step cost it learns, and the prefill it allows beside
decodes."""

from __future__ import annotations

import pytest

from aserve.core.step_cost import StepCostModel


def linear(num_tokens: int) -> float:
    return 0.015 + 0.00025 * num_tokens


def test_fit_recovers_a_linear_step_cost() -> None:
    model = StepCostModel()
    for i in range(200):
        num_tokens = (30, 512, 280, 25)[i % 4]
        model.record(num_tokens, linear(num_tokens))
    a, b = model.fit()
    assert a == pytest.approx(0.015, rel=0.01)
    assert b == pytest.approx(0.00025, rel=0.01)
    # 4 fixed costs (60 ms) buy 240 tokens
    assert model.max_prefill_tokens(4.0) in (239, 240)
    assert model.max_prefill_tokens(2.0) in (119, 120)
    # a step of 30 decodes within 2x their cost alone (a + 30 b = 22.5 ms): 60 + 30 tokens more
    assert model.mixed_step_tokens(2.0, 30) in (89, 90)
    assert model.mixed_step_tokens(1.5, 30) in (44, 45)


def test_the_cost_is_unknown_before_steps_of_different_sizes() -> None:
    model = StepCostModel()
    assert model.fit() is None and not model.is_timed
    assert model.max_prefill_tokens(4.0) is None
    assert model.mixed_step_tokens(2.0, 10) is None
    for _ in range(10):
        model.record(512, linear(512))
    assert model.is_timed
    assert model.max_prefill_tokens(4.0) is None
    model.record(32, linear(32))
    assert model.max_prefill_tokens(4.0) > 0


def test_a_fit_that_crosses_zero_keeps_the_last_good_fixed_cost() -> None:
    # The warm-up teaches two sizes; then a prompt over a long cached prefix comes in 512- and
    # 256-token chunks that cost far more per token (attention over the prefix), so a line
    # through the steps gives a fixed cost below zero: it says nothing of the fixed cost.
    model = StepCostModel()
    model.record(512, linear(512))  # the first step, left out
    for num_tokens in (512, 258):
        model.record(num_tokens, linear(num_tokens))
    good = model.fixed_cost_tokens()
    assert good == pytest.approx(0.015 / 0.00025, rel=0.01)
    for num_tokens, seconds in ((512, 0.48), (512, 0.50), (512, 0.41), (258, 0.17), (258, 0.18)):
        model.record(num_tokens, seconds)
    a, b = model.fit()
    assert a <= 0 < b  # the line now crosses zero ...
    assert model.fixed_cost_tokens() == good  # ... and the last good value stands
    assert model.max_prefill_tokens(4.0) == int(4 * good)
    assert model.mixed_step_tokens(2.0, 6) == int(good + 6)
    for _ in range(60):  # decodes: the fit makes both costs positive again, and is followed
        model.record(8, 0.02)
    a, b = model.fit()
    assert a > 0 and b > 0 and model.fixed_cost_tokens() == pytest.approx(a / b)


def test_old_steps_weigh_less_than_recent_ones() -> None:
    model = StepCostModel(decay=0.9)
    for i in range(100):
        num_tokens = (30, 300)[i % 2]
        model.record(num_tokens, linear(num_tokens))
    for i in range(100):  # the machine got twice as slow
        num_tokens = (30, 300)[i % 2]
        model.record(num_tokens, 2 * linear(num_tokens))
    a, b = model.fit()
    assert a == pytest.approx(0.030, rel=0.01)
    assert b == pytest.approx(0.0005, rel=0.01)


def test_the_first_step_is_left_out() -> None:
    model = StepCostModel()
    model.record(128, 10 * linear(128))  # the engine's first step: one-time costs
    assert not model.is_timed
    for i in range(50):
        num_tokens = (30, 300)[i % 2]
        model.record(num_tokens, linear(num_tokens))
    a, b = model.fit()
    assert a == pytest.approx(0.015, rel=0.01)
    assert b == pytest.approx(0.00025, rel=0.01)


def test_an_outlier_step_is_left_out_unless_they_keep_coming() -> None:
    from aserve.core.step_cost import MAX_OUTLIERS, OUTLIER

    model = StepCostModel()
    for i in range(20):
        num_tokens = (1, 300)[i % 2]
        model.record(num_tokens, linear(num_tokens))
    model.record(1, 1.1 * OUTLIER * linear(1))  # a pause: left out
    a, b = model.fit()
    assert a == pytest.approx(0.015, rel=0.01) and b == pytest.approx(0.00025, rel=0.01)
    model.record(600, 1.1 * OUTLIER * linear(600))  # beyond the sizes seen: learnt
    assert model.fit()[1] > 0.0003
    slow = StepCostModel()
    for i in range(20):
        num_tokens = (1, 300)[i % 2]
        slow.record(num_tokens, linear(num_tokens))
    for _ in range(MAX_OUTLIERS):  # the machine got 5x slower: left out at first...
        slow.record(150, 5 * linear(150))
    assert slow.fit()[0] == pytest.approx(0.015, rel=0.01)
    for _ in range(30):  # ...then learnt
        slow.record(150, 5 * linear(150))
    assert slow.fit()[0] + slow.fit()[1] * 150 > 3 * linear(150)


def with_keys(num_tokens: int, num_keys: int) -> float:
    return linear(num_tokens) + 2e-7 * num_keys  # a key costs 2e-7 / 2.5e-4 = 1/1250 token


def test_fit_recovers_the_attention_term_and_prices_chunks_by_their_context() -> None:
    from aserve.core.step_cost import attention_keys, chunk_cost, tokens_within

    model = StepCostModel()
    # decodes at growing contexts, and chunks of 128 and 256 tokens over 0 or 1024 cached
    steps = [(8, 8 * c) for c in (100, 400, 900)]
    steps += [(n, attention_keys(c, n)) for n in (128, 256) for c in (0, 1024)]
    for i in range(200):
        num_tokens, num_keys = steps[i % len(steps)]
        model.record(num_tokens, with_keys(num_tokens, num_keys), num_keys)
    a, b = model.fit()
    assert a == pytest.approx(0.015, rel=0.01) and b == pytest.approx(0.00025, rel=0.01)
    assert model.key_cost() == pytest.approx(2e-7, rel=0.01)
    k = model.key_cost_tokens()
    assert k == pytest.approx(1 / 1250, rel=0.01)
    # a chunk's price in tokens: its own plus its keys at k
    assert chunk_cost(128, 1024, k) == pytest.approx(128 + k * (128 * 1024 + 128 * 129 / 2))
    budget = 4 * model.fixed_cost_tokens()  # 240 tokens of b
    fresh, over_prefix = tokens_within(budget, 0, k), tokens_within(budget, 1024, k)
    assert over_prefix < fresh < budget  # the same seconds buy fewer tokens after 1k keys
    for num_computed, n in ((0, fresh), (1024, over_prefix)):  # the most within the budget
        assert chunk_cost(n, num_computed, k) <= budget < chunk_cost(n + 1, num_computed, k)
    # and what the fit predicts for that chunk is the budget's seconds, not 3x of it
    seconds = with_keys(over_prefix, attention_keys(1024, over_prefix)) - 0.015
    assert seconds == pytest.approx(budget * b, rel=0.02)


def test_without_keys_the_fit_is_the_tokens_one() -> None:
    from aserve.core.step_cost import tokens_within

    model = StepCostModel()
    for i in range(100):
        num_tokens = (30, 512, 280, 25)[i % 4]
        model.record(num_tokens, linear(num_tokens))
    assert model.key_cost() == 0.0 and model.key_cost_tokens() == 0.0
    assert tokens_within(100.0, 5000, 0.0) == 100 and tokens_within(0.0, 0, 0.1) == 0
