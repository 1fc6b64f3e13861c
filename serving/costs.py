"""What this worker's passes cost, measured on the machine it runs on: the latency model the gateway places
requests by (gateway/placement.py reads the fits from WorkerInfo; engine/core.py feeds them).

Two least-squares fits, kept current with exponential forgetting, so that they follow the machine (another process
taking a core, a throttled clock) instead of the averages of the first minutes:
- a prompt pass: seconds = a + b * tokens + c * tokens * context, where `tokens` are the tokens the pass computes
  and `context` the tokens each attends to on average (earlier chunks or a cached prefix, plus half its own);
- a decode step: seconds = a + b * batch + c * context, `context` the tokens of every running sequence.
Both start from a calibration at start-up (a few passes and steps of the sizes served) and are refitted from every
pass and step after. Pure Python: a 3x3 solve per refit.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

FORGET = 0.98  # each new sample's weight against the ones before: ~50 samples make up most of the fit
CONTEXT_UNIT = 1000.0  # features in thousands of tokens, so the normal equations stay well conditioned


class LinearFit:
    """Weighted least squares of seconds on a few features (the first is the constant 1), updated per sample.
    A solution with a negative coefficient is replaced by the best fit without that feature, so a prediction never
    falls as work grows."""

    def __init__(self, features: int, forget: float = FORGET,
                 prior: Sequence[tuple[Sequence[float], float]] = ()) -> None:
        """`prior`: samples (features, seconds) that never fade, each weighing 1: what the fit says before it has
        seen enough, and what keeps a coefficient the samples cannot tell apart (all of one size, say) near it."""
        self.n = features
        self.forget = forget
        self._xtx = [[0.0] * features for _ in range(features)]
        self._xty = [0.0] * features
        self._prior_xtx = [[sum(x[i] * x[j] for x, _ in prior) for j in range(features)] for i in range(features)]
        self._prior_xty = [sum(x[i] * y for x, y in prior) for i in range(features)]
        self.samples = 0
        self._coefficients: list[float] | None = None
        self._lock = threading.Lock()  # observed on the engine thread, read from the service's event loop

    def observe(self, x: Sequence[float], seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0) or len(x) != self.n:
            return
        with self._lock:
            for i in range(self.n):
                row = self._xtx[i]
                for j in range(self.n):
                    row[j] = self.forget * row[j] + x[i] * x[j]
                self._xty[i] = self.forget * self._xty[i] + x[i] * seconds
            self.samples += 1
            self._coefficients = None

    @property
    def coefficients(self) -> list[float]:
        """The fit's coefficients (all >= 0); zeros before any sample."""
        with self._lock:
            if self._coefficients is None:
                self._coefficients = self._solve()
            return list(self._coefficients)

    def predict(self, x: Sequence[float]) -> float:
        return sum(c * v for c, v in zip(self.coefficients, x))

    def _solve(self) -> list[float]:
        """The non-negative least-squares solution over the features kept: drop the feature with the most negative
        coefficient until none is negative (the constant is dropped last)."""
        kept = list(range(self.n))
        xtx = [[a + b for a, b in zip(row, prior)] for row, prior in zip(self._xtx, self._prior_xtx)]
        xty = [a + b for a, b in zip(self._xty, self._prior_xty)]
        while kept:
            solution = _solve([[xtx[i][j] for j in kept] for i in kept], [xty[i] for i in kept])
            if solution is None:  # too few distinct samples for this many features
                kept.pop()
                continue
            worst = min(range(len(kept)), key=lambda i: solution[i])
            if solution[worst] >= 0:
                full = [0.0] * self.n
                for i, value in zip(kept, solution):
                    full[i] = value
                return full
            kept.pop(worst)
        return [0.0] * self.n


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting; None when a is (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def pass_features(tokens: int, context: float) -> tuple[float, float, float]:
    """A prompt pass computing `tokens` tokens, each attending to `context` tokens on average."""
    return 1.0, tokens / CONTEXT_UNIT, tokens * context / CONTEXT_UNIT**2


def step_features(batch: int, context: int) -> tuple[float, float, float]:
    """A decode step over `batch` sequences holding `context` tokens in all."""
    return 1.0, float(batch), context / CONTEXT_UNIT


class Costs:
    """This worker's prompt-pass and decode-step fits."""

    def __init__(self) -> None:
        self.passes = LinearFit(3)
        self.steps = LinearFit(3)

    def observe_pass(self, tokens: int, start: int, seconds: float) -> None:
        """A pass computed `tokens` tokens after `start` tokens already in the sequence's cache."""
        self.passes.observe(pass_features(tokens, start + tokens / 2), seconds)

    def observe_step(self, batch: int, context: int, seconds: float) -> None:
        self.steps.observe(step_features(batch, context), seconds)

    def prompt_s(self, tokens: int, cached: int = 0, chunk: int = 0) -> float:
        """Predicted seconds to prefill `tokens` prompt tokens after `cached` ones, in passes of `chunk` tokens
        (0: one pass)."""
        return prompt_seconds(self.passes.coefficients, tokens, cached, chunk)

    def step_s(self, batch: int, context: int) -> float:
        return self.steps.predict(step_features(batch, context))


def prompt_seconds(coefficients: Sequence[float], tokens: int, cached: int = 0, chunk: int = 0) -> float:
    """Seconds to prefill `tokens` tokens after `cached` ones in passes of `chunk` tokens (0: one pass), by the
    pass fit's coefficients (a, b, c): the sum over the passes."""
    if tokens <= 0:
        return 0.0
    a, b, c = coefficients
    chunk = chunk or tokens
    total, done = 0.0, cached
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        _, x1, x2 = pass_features(n, done + n / 2)
        total += a + b * x1 + c * x2
        done += n
    return total
