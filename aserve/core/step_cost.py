"""`StepCostModel`: what a step costs, learnt from the steps that ran; `prefill_token_cap`: the
`PrefillPolicy` (`config.py`) applied with it.

    seconds ≈ a + b · scheduled tokens + c · attention keys

a is a step's fixed cost (every weight read once, the step's overheads: what a few decodes
pay), b the cost of one more token, c of one more key a query attends (the keys of a step:
Σ over its rows of the tokens each row's query reads, `attention_keys`). Without c a chunk
over a long cached prefix costs several times what its tokens say. It is fitted by least
squares over the recorded steps, older ones weighted down by `decay` per step (so the fit
follows the load), with a small ridge on b and on c (the keys counted in KEY_SCALE units, so
both are of a size) so that steps all of one shape still give a fit (the costs it cannot tell
apart shrink toward zero: unknown). A step far slower than the fit predicts for a size it
has seen is left out (`OUTLIER`). Pure Python: the seconds come from the runner's output, not
a clock read here.

Budgets are in tokens of b: a / b tokens cost a fixed cost (`fixed_cost_tokens`), a key c / b
tokens (`key_cost_tokens`), so n tokens after a context of C cost `chunk_cost(n, C, k)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from aserve.config import PrefillPolicy, SchedulerConfig

RIDGE = 1.0  # added to Σ tokens² (Σ keys², in KEY_SCALE units) per unit of weight: one token²
KEY_SCALE = 1024.0  # keys per unit in the fit: one token's attention over 1024 keys
# A step this many times what the fit predicts for its size, among the sizes seen, is an outlier
# (a one-time cost, a pause), not a cost to learn; MAX_OUTLIERS of them in a row are the new
# normal (the machine slowed down) and are learnt.
OUTLIER = 4.0
MAX_OUTLIERS = 3


class StepCostModel:
    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        # Σ w·v over the steps for v in the products of (1, x, y, t): x tokens, y keys / KEY_SCALE,
        # t seconds (`_solve`'s normal equations)
        self._sums = dict.fromkeys(("1", "x", "y", "xx", "xy", "yy", "t", "xt", "yt"), 0.0)
        self._coefficients: tuple[float, float, float] | None = None  # (a, b, c · KEY_SCALE)
        self._is_first = True
        self._sizes = (0, 0)  # the fewest and most tokens of a recorded step
        self._outliers = 0  # left out in a row
        self._fixed_cost_tokens: float | None = None  # a / b of the last fit with both > 0
        self._key_cost_tokens = 0.0  # c / b of that fit (0 where c <= 0)

    def record(self, num_tokens: int, seconds: float, num_keys: int = 0) -> None:
        """One step's scheduled tokens, seconds and attention keys (`attention_keys` summed
        over its rows). The first step is left out: it pays the engine's one-time costs
        (first touches of buffers and caches), which would teach a fixed cost several times
        too large. So is a later outlier (`_is_outlier`: a pause, a first use of some
        buffer), unless MAX_OUTLIERS came in a row."""
        if self._is_first:
            self._is_first = False
            return
        if not self._is_outlier(num_tokens, seconds, num_keys):
            self._outliers = 0
        elif self._outliers < MAX_OUTLIERS:
            self._outliers += 1
            return
        low, high = self._sizes if self._sums["1"] else (num_tokens, num_tokens)
        self._sizes = (min(low, num_tokens), max(high, num_tokens))
        d, x, y, t = self.decay, float(num_tokens), num_keys / KEY_SCALE, seconds
        for name, value in (("1", 1.0), ("x", x), ("y", y), ("xx", x * x), ("xy", x * y),
                            ("yy", y * y), ("t", t), ("xt", x * t), ("yt", y * t)):
            self._sums[name] = d * self._sums[name] + value
        self._coefficients = self._solve()
        a, b, c = self._coefficients
        if a > 0 and b > 0:
            self._fixed_cost_tokens = a / b
            self._key_cost_tokens = max(c, 0.0) / KEY_SCALE / b

    def _solve(self) -> tuple[float, float, float]:
        """(a, b, c · KEY_SCALE) minimizing the weighted squared error plus the ridge: the
        normal equations of b and c over centred sums (times Σw, so that steps all of one size
        give a covariance of exactly 0, and b = 0), then a from the means."""
        s = self._sums
        w = s["1"]
        ridge = RIDGE * w * w
        cxx = w * s["xx"] - s["x"] * s["x"] + ridge
        cyy = w * s["yy"] - s["y"] * s["y"] + ridge
        cxy = w * s["xy"] - s["x"] * s["y"]
        cxt = w * s["xt"] - s["x"] * s["t"]
        cyt = w * s["yt"] - s["y"] * s["t"]
        det = cxx * cyy - cxy * cxy
        b = (cxt * cyy - cxy * cyt) / det
        c = (cxx * cyt - cxy * cxt) / det
        return (s["t"] - b * s["x"] - c * s["y"]) / w, b, c

    def _is_outlier(self, num_tokens: int, seconds: float, num_keys: int) -> bool:
        """Over OUTLIER times the fit's cost for a size within those seen (beyond them the fit
        extrapolates, and a step is what teaches it)."""
        if self._coefficients is None or not self._sizes[0] <= num_tokens <= self._sizes[1]:
            return False
        a, b, c = self._coefficients
        predicted = a + b * num_tokens + c * num_keys / KEY_SCALE
        return predicted > 0 and seconds > OUTLIER * predicted

    @property
    def is_timed(self) -> bool:
        """Whether any recorded step took time (a fake runner's take none)."""
        return self._sums["t"] > 0

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds per step, seconds per token; None before any step."""
        return None if self._coefficients is None else self._coefficients[:2]

    def key_cost(self) -> float | None:
        """c: seconds per attention key; None before any step."""
        return None if self._coefficients is None else self._coefficients[2] / KEY_SCALE

    def key_cost_tokens(self) -> float:
        """c / b, the tokens one attention key costs, from the last fit that made a and b
        positive; 0 until one did, or where that fit found no cost in keys."""
        return self._key_cost_tokens

    def max_prefill_tokens(self, ratio: float) -> int | None:
        """The prefill tokens that cost `ratio` times a step's fixed cost: beside decodes, a
        chunk that large keeps the step within (1 + ratio) times the decodes alone, and runs at
        ratio / (1 + ratio) of the speed of a chunk as large as the budget allows, or better.
        None while that is unknown (`fixed_cost_tokens`)."""
        tokens = self.fixed_cost_tokens()
        return None if tokens is None else int(ratio * tokens)

    def mixed_step_tokens(self, ratio: float, num_decodes: float) -> int | None:
        """The prefill tokens that keep a step of `num_decodes` decodes (their cost in tokens:
        more than their number where the fit has a key cost) within `ratio` times the decodes
        alone: a + b (D + P) <= ratio (a + b D), so P <= (ratio - 1)(a / b + D). None while
        that is unknown."""
        tokens = self.fixed_cost_tokens()
        return None if tokens is None else int((ratio - 1) * (tokens + num_decodes))

    def fixed_cost_tokens(self) -> float | None:
        """a / b, the tokens that cost one fixed cost, from the last fit that made both costs
        positive; None until one did (no steps of different sizes yet). A later fit that makes
        either cost zero or less says nothing of it, so the last good value stands: a token's
        cost grows with its context, and a line through chunks over a long cached prefix can
        cross zero."""
        return self._fixed_cost_tokens


def attention_keys(num_computed: int, num_tokens: int) -> int:
    """The keys `num_tokens` query rows after `num_computed` tokens attend (causal: row p reads
    p + 1)."""
    return num_tokens * num_computed + num_tokens * (num_tokens + 1) // 2


def chunk_cost(num_tokens: int, num_computed: int, key_cost_tokens: float) -> float:
    """What `num_tokens` rows after `num_computed` tokens cost, in tokens of b."""
    return num_tokens + key_cost_tokens * attention_keys(num_computed, num_tokens)


def tokens_within(budget: float, num_computed: int, key_cost_tokens: float) -> int:
    """The most rows after `num_computed` tokens whose `chunk_cost` is within `budget`: the
    root of k n² / 2 + (1 + k (C + 1 / 2)) n = budget."""
    if budget <= 0:
        return 0
    k = key_cost_tokens
    if k <= 0:
        return int(budget)
    linear = 1.0 + k * (num_computed + 0.5)
    n = int((math.sqrt(linear * linear + 2.0 * k * budget) - linear) / k)
    while n > 0 and chunk_cost(n, num_computed, k) > budget:  # (float rounding)
        n -= 1
    return n


def prefill_token_cap(config: SchedulerConfig, cost: StepCostModel, num_decoding: int,
                      pending_within: Callable[[float], float], block_size: int,
                      decode_cost: float) -> int | None:
    """Prefill a step beside `num_decoding` streams may carry, by `config.prefill`
    (`PrefillPolicy`, which states the rule), in tokens of the fit (`chunk_cost` prices a
    chunk by its context): None (no cap: the step's whole token budget, tokens as they come)
    without a ratio for this step or step times; half the budget while the fixed cost is
    unknown; else what the ratio of fixed costs buys, lowered by the mixed-step cap, never
    under one block. `pending_within(limit)`: the prompt tokens pending (priced the same
    way), counted up to `limit`; `decode_cost`: the decodes' cost in tokens (their number and
    their contexts' keys)."""
    policy, budget = config.prefill, config.max_num_batched_tokens
    ratio = policy.step_ratio(num_decoding)
    if ratio <= 0 or not cost.is_timed:
        return None
    cap = cost.max_prefill_tokens(ratio)
    if cap is None:
        return budget // 2
    if policy.max_mixed_step_ratio:
        cap = mixed_step_cap(policy, cost, cap, num_decoding, pending_within, decode_cost)
    return max(cap, block_size)


def mixed_step_cap(policy: PrefillPolicy, cost: StepCostModel, cap: int, num_decoding: int,
                   pending_within: Callable[[float], float], decode_cost: float) -> int:
    """`cap` lowered to the prefill tokens that keep a step of D decodes within
    `max_mixed_step_ratio` times the decodes alone (`StepCostModel.mixed_step_tokens`, the
    decodes costing `decode_cost`), or to the rate that prefills the prompts pending within
    `policy.drain_steps(D)` steps where that is more."""
    target = cost.mixed_step_tokens(policy.max_mixed_step_ratio, decode_cost)
    if target is None or target >= cap:
        return cap
    steps = policy.drain_steps(num_decoding)
    return max(target, int(pending_within(cap * steps) // steps))
