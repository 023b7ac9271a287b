"""StepCostModel: the least-squares step cost it learns, and the prefill it allows beside
decodes."""

from __future__ import annotations

import pytest

from aserve.core.step_cost import StepCostModel


def linear(num_prefill: int, num_decode: int) -> float:
    return 0.010 + 0.001 * num_prefill + 0.0005 * num_decode


def test_fit_recovers_a_linear_step_cost() -> None:
    model = StepCostModel()
    for i in range(200):
        prefill, decode = (0, 512, 128, 37)[i % 4], 1 + i % 32
        model.record(prefill, decode, linear(prefill, decode))
    a, b, c = model.fit()
    assert a == pytest.approx(0.010, rel=0.01)
    assert b == pytest.approx(0.001, rel=0.01)
    assert c == pytest.approx(0.0005, rel=0.03)  # the ridge shrinks it a little
    # a step of 20 decodes takes 20 ms: at twice that, 20 ms of prefill = 20 tokens
    assert model.max_prefill_tokens(20, ratio=2.0) in (19, 20)
    assert model.max_prefill_tokens(20, ratio=3.0) in (39, 40)


def test_a_constant_decode_count_still_predicts_its_steps() -> None:
    model = StepCostModel()
    for i in range(100):  # always 32 decodes: a and c cannot be told apart, a + 32 c can
        prefill = 256 if i % 8 == 0 else 0
        model.record(prefill, 32, linear(prefill, 32))
    a, b, c = model.fit()
    assert a + 32 * c == pytest.approx(linear(0, 32), rel=0.01)
    assert b == pytest.approx(0.001, rel=0.01)


def test_prefill_cost_is_unknown_before_a_step_with_prefill() -> None:
    model = StepCostModel()
    assert model.fit() is None
    assert model.max_prefill_tokens(8, ratio=2.0) is None
    for decode in (4, 8, 16):
        model.record(0, decode, linear(0, decode))
    assert model.max_prefill_tokens(8, ratio=2.0) is None
    model.record(64, 8, linear(64, 8))
    assert model.max_prefill_tokens(8, ratio=2.0) > 0


def test_old_steps_weigh_less_than_recent_ones() -> None:
    model = StepCostModel(decay=0.9)
    for i in range(100):
        prefill = (0, 128)[i % 2]
        model.record(prefill, 8, linear(prefill, 8))
    for i in range(100):  # the machine got twice as slow
        prefill = (0, 128)[i % 2]
        model.record(prefill, 8, 2 * linear(prefill, 8))
    _, b, _ = model.fit()
    assert b == pytest.approx(0.002, rel=0.01)
