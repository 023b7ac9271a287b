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


def test_the_cost_is_unknown_before_steps_of_different_sizes() -> None:
    model = StepCostModel()
    assert model.fit() is None and not model.is_timed
    assert model.max_prefill_tokens(4.0) is None
    for _ in range(10):
        model.record(512, linear(512))
    assert model.is_timed
    assert model.max_prefill_tokens(4.0) is None
    model.record(32, linear(32))
    assert model.max_prefill_tokens(4.0) > 0


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
