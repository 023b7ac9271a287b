"""`StepCostModel`: what a step costs, learnt from the steps that ran; `prefill_token_cap`: the
`PrefillPolicy` (`config.py`) applied with it.

    seconds ≈ a + b · scheduled tokens

a is a step's fixed cost (every weight read once, the step's overheads: what a few decodes
pay), b the cost of one more token. It is fitted by least squares over the recorded steps,
older ones weighted down by `decay` per step (so the fit follows the load), with a small ridge
on b so that steps all of one size still give a fit (b then shrinks to zero: unknown). A step
far slower than the fit predicts for a size it has seen is left out (`OUTLIER`). Pure Python:
the seconds come from the runner's output, not a clock read here.
"""

from __future__ import annotations

from collections.abc import Callable

from aserve.config import PrefillPolicy, SchedulerConfig

RIDGE = 1.0  # added to Σ tokens² per unit of weight: one token², nothing at real sizes
# A step this many times what the fit predicts for its size, among the sizes seen, is an outlier
# (a one-time cost, a pause), not a cost to learn; MAX_OUTLIERS of them in a row are the new
# normal (the machine slowed down) and are learnt.
OUTLIER = 4.0
MAX_OUTLIERS = 3


class StepCostModel:
    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._wx = self._wxx = self._wt = self._wxt = 0.0  # Σ w·(1, x, x², t, x·t)
        self._is_first = True
        self._sizes = (0, 0)  # the fewest and most tokens of a recorded step
        self._outliers = 0  # left out in a row
        self._fixed_cost_tokens: float | None = None  # a / b of the last fit with both > 0

    def record(self, num_tokens: int, seconds: float) -> None:
        """One step's scheduled tokens and seconds. The first step is left out: it pays the
        engine's one-time costs (first touches of buffers and caches), which would teach a
        fixed cost several times too large. So is a later outlier (`_is_outlier`: a pause, a
        first use of some buffer), unless MAX_OUTLIERS came in a row."""
        if self._is_first:
            self._is_first = False
            return
        if not self._is_outlier(num_tokens, seconds):
            self._outliers = 0
        elif self._outliers < MAX_OUTLIERS:
            self._outliers += 1
            return
        low, high = self._sizes if self._w else (num_tokens, num_tokens)
        self._sizes = (min(low, num_tokens), max(high, num_tokens))
        d, x = self.decay, float(num_tokens)
        self._w = d * self._w + 1.0
        self._wx = d * self._wx + x
        self._wxx = d * self._wxx + x * x
        self._wt = d * self._wt + seconds
        self._wxt = d * self._wxt + x * seconds
        a, b = self.fit()
        if a > 0 and b > 0:
            self._fixed_cost_tokens = a / b

    def _is_outlier(self, num_tokens: int, seconds: float) -> bool:
        """Over OUTLIER times the fit's cost for a size within those seen (beyond them the fit
        extrapolates, and a step is what teaches it)."""
        coefficients = self.fit()
        if coefficients is None or not self._sizes[0] <= num_tokens <= self._sizes[1]:
            return False
        predicted = coefficients[0] + coefficients[1] * num_tokens
        return predicted > 0 and seconds > OUTLIER * predicted

    @property
    def is_timed(self) -> bool:
        """Whether any recorded step took time (a fake runner's take none)."""
        return self._wt > 0

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds per step, seconds per token; None before any step."""
        if self._w <= 0:
            return None
        sxx = self._wxx + RIDGE * self._w
        det = self._w * sxx - self._wx * self._wx
        b = (self._w * self._wxt - self._wx * self._wt) / det
        return (self._wt - b * self._wx) / self._w, b

    def max_prefill_tokens(self, ratio: float) -> int | None:
        """The prefill tokens that cost `ratio` times a step's fixed cost: beside decodes, a
        chunk that large keeps the step within (1 + ratio) times the decodes alone, and runs at
        ratio / (1 + ratio) of the speed of a chunk as large as the budget allows, or better.
        None while that is unknown (`fixed_cost_tokens`)."""
        tokens = self.fixed_cost_tokens()
        return None if tokens is None else int(ratio * tokens)

    def mixed_step_tokens(self, ratio: float, num_decodes: int) -> int | None:
        """The prefill tokens that keep a step of `num_decodes` decodes within `ratio` times
        the decodes alone: a + b (D + P) <= ratio (a + b D), so P <= (ratio - 1)(a / b + D).
        None while that is unknown."""
        tokens = self.fixed_cost_tokens()
        return None if tokens is None else int((ratio - 1) * (tokens + num_decodes))

    def fixed_cost_tokens(self) -> float | None:
        """a / b, the tokens that cost one fixed cost, from the last fit that made both costs
        positive; None until one did (no steps of different sizes yet). A later fit that makes
        either cost zero or less says nothing of it, so the last good value stands: a token's
        cost grows with its context, and a line through chunks over a long cached prefix can
        cross zero."""
        return self._fixed_cost_tokens


def prefill_token_cap(config: SchedulerConfig, cost: StepCostModel, num_decoding: int,
                      pending_within: Callable[[int], int], block_size: int) -> int:
    """Prefill tokens a step beside `num_decoding` streams may carry, by `config.prefill`
    (`PrefillPolicy`, which states the rule): the whole budget without a ratio for this step
    or step times; half of it while the fixed cost is unknown; else what the ratio of fixed
    costs buys, lowered by the mixed-step cap, never under one block. `pending_within(limit)`:
    the prompt tokens pending, counted up to `limit`."""
    policy, budget = config.prefill, config.max_num_batched_tokens
    ratio = policy.step_ratio(num_decoding)
    if ratio <= 0 or not cost.is_timed:
        return budget
    cap = cost.max_prefill_tokens(ratio)
    if cap is None:
        return budget // 2
    if policy.max_mixed_step_ratio:
        cap = mixed_step_cap(policy, cost, cap, num_decoding, pending_within)
    return max(cap, block_size)


def mixed_step_cap(policy: PrefillPolicy, cost: StepCostModel, cap: int, num_decoding: int,
                   pending_within: Callable[[int], int]) -> int:
    """`cap` lowered to the prefill tokens that keep a step of D decodes within
    `max_mixed_step_ratio` times the decodes alone (`StepCostModel.mixed_step_tokens`), or to
    the rate that prefills the prompts pending within `policy.drain_steps(D)` steps where that
    is more."""
    target = cost.mixed_step_tokens(policy.max_mixed_step_ratio, num_decoding)
    if target is None or target >= cap:
        return cap
    steps = policy.drain_steps(num_decoding)
    return max(target, pending_within(cap * steps) // steps)
