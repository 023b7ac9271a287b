"""`StepCostModel`: what a step costs, learnt from the steps that ran.

    seconds ≈ a + b · prefill tokens + c · decode tokens

a is a step's fixed cost (every weight read once, the step's overheads: what one decode pays),
b the cost of one more prompt token, c of one more decode (its attention over its whole
context, its sampling and bookkeeping). They differ: the chat workload's steps on a 2-core Xeon
fit b = 0.67 and c = 1.25 ms, the prefix workload's (1k-token contexts) 1.96 and 3.5. One slope
for both prices a step by the average mix, so a step of many decodes and few prompt tokens (the
mixed steps that stall the most streams) is priced wrong. It is fitted by weighted least
squares over the recorded steps, older ones weighted down by `decay` per step (so the fit
follows the load), with a small ridge on b and c so that steps all of one kind still give a fit
(a slope with nothing to tell it shrinks to zero: unknown). The scheduler asks
`prefill_token_cap` how many prefill tokens a step may take, which asks the model
(`max_prefill_tokens`: a multiple of the fixed cost; `mixed_step_tokens`: a multiple of the
decodes alone). A step far slower than the fit predicts, at a size it has seen, is left out
(`OUTLIER`). Pure Python: the seconds come from the runner's output, not a clock read here.
`StepBudget` is what is left of one step's budgets while the scheduler spends them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aserve.config import SchedulerConfig

RIDGE = 0.01  # added to Σ tokens² per unit of weight: nothing at real sizes (steps of 1 token on)
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
        # Σ w·u·v over u, v in (1, prefill, decode), and Σ w·u·seconds: the normal equations
        self._sums = [[0.0] * 3 for _ in range(3)]
        self._targets = [0.0] * 3
        self._is_first = True
        self._sizes = (0, 0)  # the fewest and most tokens of a recorded step
        self._outliers = 0  # left out in a row

    def record(self, num_tokens: int, seconds: float, num_decode_tokens: int = 0) -> None:
        """One step's scheduled tokens (`num_decode_tokens` of them decodes) and seconds. The
        first step is left out: it pays the engine's one-time costs (first touches of buffers
        and caches), 2-4× a later step of its size, which would teach a fixed cost several
        times too large. So is a later outlier (`_is_outlier`: a pause, a first use of some
        buffer), unless MAX_OUTLIERS came in a row."""
        if self._is_first:
            self._is_first = False
            return
        if not self._is_outlier(num_tokens, seconds, num_decode_tokens):
            self._outliers = 0
        elif self._outliers < MAX_OUTLIERS:
            self._outliers += 1
            return
        low, high = self._sizes if self._sums[0][0] else (num_tokens, num_tokens)
        self._sizes = (min(low, num_tokens), max(high, num_tokens))
        d = self.decay
        x = (1.0, float(num_tokens - num_decode_tokens), float(num_decode_tokens))
        for i in range(3):
            self._targets[i] = d * self._targets[i] + x[i] * seconds
            for j in range(3):
                self._sums[i][j] = d * self._sums[i][j] + x[i] * x[j]

    def _is_outlier(self, num_tokens: int, seconds: float, num_decode_tokens: int) -> bool:
        """Over OUTLIER times the fit's cost for a size within those seen (beyond them the fit
        extrapolates, and a step is what teaches it)."""
        if not self._sizes[0] <= num_tokens <= self._sizes[1]:
            return False
        predicted = self.predict(num_tokens - num_decode_tokens, num_decode_tokens)
        return predicted is not None and predicted > 0 and seconds > OUTLIER * predicted

    @property
    def is_timed(self) -> bool:
        """Whether any recorded step took time (a fake runner's take none)."""
        return self._targets[0] > 0

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c): seconds per step, per prefill token, per decode token; None before any
        step."""
        w = self._sums[0][0]
        if w <= 0:
            return None
        m = [row[:] + [t] for row, t in zip(self._sums, self._targets, strict=True)]
        m[1][1] += RIDGE * w
        m[2][2] += RIDGE * w
        for col in range(3):  # Gaussian elimination; the ridge keeps every pivot positive
            for row in range(col + 1, 3):
                f = m[row][col] / m[col][col]
                for k in range(col, 4):
                    m[row][k] -= f * m[col][k]
        x = [0.0] * 3
        for row in (2, 1, 0):
            x[row] = (m[row][3] - sum(m[row][k] * x[k] for k in range(row + 1, 3))) / m[row][row]
        return x[0], x[1], x[2]

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds per step, seconds per prefill token (per token, for steps recorded
        without their decodes); None before any step."""
        coefficients = self.coefficients()
        return None if coefficients is None else coefficients[:2]

    def predict(self, num_prefill_tokens: int, num_decode_tokens: int = 0) -> float | None:
        """A step's seconds by the fit; None before any step."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        a, b, c = coefficients
        return a + b * num_prefill_tokens + max(c, 0.0) * num_decode_tokens

    def max_prefill_tokens(self, ratio: float) -> int | None:
        """The prefill tokens that cost `ratio` times a step's fixed cost: beside decodes, a
        chunk that large keeps the step within (1 + ratio) times the decodes alone, and runs at
        ratio / (1 + ratio) of the speed of a chunk as large as the budget allows, or better.
        None while that is unknown (`_fixed_cost_tokens`)."""
        tokens = self._fixed_cost_tokens()
        return None if tokens is None else int(ratio * tokens)

    def mixed_step_tokens(self, ratio: float, num_decodes: int) -> int | None:
        """The prefill tokens that keep a step of `num_decodes` decodes within `ratio` times
        the decodes alone: a + b P + c D <= ratio (a + c D), so P <= (ratio - 1)(a + c D) / b.
        None while that is unknown."""
        tokens = self._fixed_cost_tokens()
        if tokens is None:
            return None
        a, b, c = self.coefficients()
        return int((ratio - 1) * (tokens + max(c, 0.0) * num_decodes / b))

    def _fixed_cost_tokens(self) -> float | None:
        """a / b, the prefill tokens that cost one fixed cost; None while unknown (no steps of
        different sizes yet, or a fit that makes either cost zero or less)."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        a, b, _ = coefficients
        return a / b if a > 0 and b > 0 else None


def prefill_token_cap(config: SchedulerConfig, cost: StepCostModel, num_decoding: int,
                      pending_within: Callable[[int], int], block_size: int) -> int:
    """Prefill tokens a step may carry: the whole budget, unless it carries decodes
    (`num_decoding` streams); then what `max_prefill_step_ratio` times a step's fixed cost
    buys (never under one block, so that prompts move on), or half the budget while the cost
    model cannot tell it yet (a step of another size than the full ones before teaches it).
    With `prefill_cap_decodes` N and more than N streams decoding, the ratio is scaled by
    N / streams. With `max_mixed_step_ratio`, the step is also held to that ratio of its
    decodes alone while the prompts pending allow (`mixed_step_cap`; `pending_within(limit)`:
    the prompt tokens pending, counted up to limit). A runner that reports no step times gets
    no cap."""
    budget, ratio = config.max_num_batched_tokens, config.max_prefill_step_ratio
    if ratio <= 0 or not cost.is_timed or not num_decoding:
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
