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
