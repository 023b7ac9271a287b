"""`StepCostModel`: what a step costs, learnt from the steps that ran.

    seconds ≈ a + b · scheduled tokens

a is a step's fixed cost (every weight read once, the step's overheads: what a few decodes
pay), b the cost of one more token. It is fitted by least squares over the recorded steps,
older ones weighted down by `decay` per step (so the fit follows the load), with a small ridge
on b so that steps all of one size still give a fit (b then shrinks to zero: unknown). The
scheduler asks `prefill_token_cap` how many prefill tokens a step may take, which asks the
model (`max_prefill_tokens`: a multiple of the fixed cost; `mixed_step_tokens`: a multiple of
the decodes alone). A step far slower than the fit predicts for a size it has seen is left out
(`OUTLIER`). Pure Python: the seconds come from the runner's output, not a clock
read here. `StepBudget` is what is left of one step's budgets while the scheduler spends them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aserve.config import SchedulerConfig

RIDGE = 1.0  # added to Σ tokens² per unit of weight: one token², nothing at real sizes
# A step this many times what the fit predicts for its size, among the sizes seen, is an outlier
# (a one-time cost, a pause), not a cost to learn; MAX_OUTLIERS of them in a row are the new
# normal (the machine slowed down) and are learnt.
OUTLIER = 4.0
MAX_OUTLIERS = 3
# A mixed step held to `max_mixed_step_ratio` times its decodes alone may leave prompts
# pending: the cap rises to what prefills them within this many steps per stream decoding, at
# most PREFILL_DRAIN_STEPS (`mixed_step_cap`; BENCHMARKS.md, "Stutter under many streams" and
# "Spreading a prompt over the steps of the streams it stalls").
DRAIN_STEPS_PER_DECODE = 2
PREFILL_DRAIN_STEPS = 32


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
        engine's one-time costs (first touches of buffers and caches), 2-4× a later step of
        its size, which would teach a fixed cost several times too large. So is a later
        outlier (`_is_outlier`: a pause, a first use of some buffer), unless MAX_OUTLIERS came
        in a row."""
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
        either cost zero or less says nothing of it, so the last good value stands: that
        happens when a token's cost grows with its context, e.g. a prompt's chunks over a long
        cached prefix cost more per token than the steps before, and a line through them
        crosses zero (measured: 512-token chunks over a 1k prefix, then 256-token ones while
        the fit could not tell, stalled the first streams 200 ms a step; BENCHMARKS.md)."""
        return self._fixed_cost_tokens


def prefill_token_cap(config: SchedulerConfig, cost: StepCostModel, num_decoding: int,
                      pending_within: Callable[[int], int], block_size: int) -> int:
    """Prefill tokens a step may carry: the whole budget, unless it carries more decodes
    (`num_decoding` streams) than `prefill_first_streams` (few streams stall, and a long
    prompt among them reaches its first token sooner); then what `max_prefill_step_ratio`
    times a step's fixed cost buys (never under one block, so that prompts move on), or half
    the budget while the cost model cannot tell it yet (a step of another size than the full
    ones before teaches it).
    With `prefill_cap_decodes` N and more than N streams decoding, the ratio is scaled by
    N / streams. With `max_mixed_step_ratio`, the step is also held to that ratio of its
    decodes alone while the prompts pending allow (`mixed_step_cap`; `pending_within(limit)`:
    the prompt tokens pending, counted up to limit). A runner that reports no step times gets
    no cap."""
    budget, ratio = config.max_num_batched_tokens, config.max_prefill_step_ratio
    if (ratio <= 0 or not cost.is_timed or not num_decoding
            or num_decoding <= config.prefill_first_streams):
        return budget
    streams = config.prefill_cap_decodes
    if streams and num_decoding > streams:
        ratio *= streams / num_decoding
    cap = cost.max_prefill_tokens(ratio)
    if cap is None:
        return budget // 2
    if config.max_mixed_step_ratio:
        cap = mixed_step_cap(cost, config.max_mixed_step_ratio, cap, num_decoding,
                             pending_within)
    return max(cap, block_size)


def mixed_step_cap(cost: StepCostModel, ratio: float, cap: int, num_decoding: int,
                   pending_within: Callable[[int], int]) -> int:
    """`cap` lowered to the target of the mixed-step `ratio` r: the prefill tokens that keep a
    step of D decodes within r times the decodes alone (`StepCostModel.mixed_step_tokens`),
    unless the prompt tokens pending (the whole prompts of running prefills and waiting
    requests, past their cached prefix) need more to be prefilled within
    min(DRAIN_STEPS_PER_DECODE · D, PREFILL_DRAIN_STEPS) steps. Every stream waits out a
    mixed step, so a prompt is spread over more, shorter steps the more streams it would
    stall (a reader sees a long step as stutter); a long prompt among few streams keeps
    `cap` (its TTFT), and prompts arriving faster than the target admits them cannot queue
    (the decode batch would shrink)."""
    target = cost.mixed_step_tokens(ratio, num_decoding)
    if target is None or target >= cap:
        return cap
    steps = min(DRAIN_STEPS_PER_DECODE * num_decoding, PREFILL_DRAIN_STEPS)
    return max(target, pending_within(cap * steps) // steps)


@dataclass
class StepBudget:
    """What is left of one step's token budget, and of the part of it prefill may take."""

    num_tokens: int
    num_prefill_tokens: int

    def limit(self, is_prefill: bool) -> int:
        return min(self.num_tokens, self.num_prefill_tokens) if is_prefill else self.num_tokens

    def spend(self, num_tokens: int, is_prefill: bool) -> None:
        self.num_tokens -= num_tokens
        if is_prefill:
            self.num_prefill_tokens -= num_tokens
