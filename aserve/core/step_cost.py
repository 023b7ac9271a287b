"""`StepCostModel`: what a step costs, learnt from the steps that ran.

    seconds ≈ a + b · prefill tokens + c · decode tokens

fitted by least squares over the recorded steps, older ones weighted down by `decay` per step
(so the fit follows the load: contexts grow, the machine gets busier), with a small ridge on b
and c so that a batch whose decode count never changes (or that has no prefill yet) still
gives a fit: its slope then shrinks to zero and a takes the mean. The scheduler asks it how
many prefill tokens a step may carry beside its decodes (`max_prefill_tokens`). Pure Python:
the seconds come from the runner's output, not a clock read here.
"""

from __future__ import annotations

RIDGE = 1.0  # added to the P·P and D·D sums per unit of weight: one token², nothing at real sizes


class StepCostModel:
    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._xx = [[0.0] * 3 for _ in range(3)]  # Σ w · x xᵀ, x = (1, prefill, decode)
        self._xt = [0.0] * 3  # Σ w · x · seconds

    def record(self, num_prefill_tokens: int, num_decode_tokens: int, seconds: float) -> None:
        x = (1.0, float(num_prefill_tokens), float(num_decode_tokens))
        for i in range(3):
            self._xt[i] = self.decay * self._xt[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds, seconds per prefill token, seconds per decode token; None
        before any step."""
        weight = self._xx[0][0]
        if weight <= 0:
            return None
        m = [row[:] for row in self._xx]
        m[1][1] += RIDGE * weight
        m[2][2] += RIDGE * weight
        return _solve3(m, self._xt)

    def max_prefill_tokens(self, num_decode_tokens: int, ratio: float) -> int | None:
        """The most prefill tokens a step with these decodes may carry and still take no more
        than `ratio` times the same decodes alone; None while prefill's cost is unknown (no
        step with prefill yet, or a fit that finds it free)."""
        coefficients = self.fit()
        if coefficients is None:
            return None
        a, b, c = coefficients
        decode_seconds = a + c * num_decode_tokens
        if b <= 0 or decode_seconds <= 0:
            return None
        return int((ratio - 1) * decode_seconds / b)


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """m⁻¹ v by Cramer's rule (m is symmetric positive definite here, or singular: None)."""
    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    if d == 0:
        return None
    out = []
    for k in range(3):
        mk = [[v[i] if j == k else m[i][j] for j in range(3)] for i in range(3)]
        out.append(det(mk) / d)
    return out[0], out[1], out[2]
