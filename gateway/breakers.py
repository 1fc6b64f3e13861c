"""Circuit breakers: a worker, or a prefill -> decode path, that failed lately is tried last for a while."""

from __future__ import annotations

import time
from dataclasses import dataclass

BREAKER_OPEN_S = 1.0  # a failed worker or path is tried last for this long, doubling per consecutive failure
BREAKER_MAX_OPEN_S = 30.0


@dataclass
class Breaker:
    """A circuit breaker, for a worker or a prefill -> decode path: each consecutive failure opens it for twice as
    long, a success closes it. What an open breaker guards is tried last, not never: it may be all that is left."""

    failures: int = 0  # consecutive
    open_until: float = 0.0  # monotonic time

    def failed(self) -> None:
        self.failures += 1
        self.open_until = time.monotonic() + min(BREAKER_MAX_OPEN_S, BREAKER_OPEN_S * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        self.failures, self.open_until = 0, 0.0

    def is_open(self, now: float | None = None) -> bool:
        return self.open_until > (time.monotonic() if now is None else now)



class PairBreakers:
    """A Breaker per prefill -> decode path: two workers that each answer may still fail to hand KV over (a
    broken link between them)."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], Breaker] = {}  # (prefill, decode) -> its breaker, while not closed

    def failed(self, prefill: str, decode: str) -> None:
        self._pairs.setdefault((prefill, decode), Breaker()).failed()

    def succeeded(self, prefill: str, decode: str) -> None:
        self._pairs.pop((prefill, decode), None)

    def is_open(self, prefill: str, decode: str) -> bool:
        breaker = self._pairs.get((prefill, decode))
        return breaker is not None and breaker.is_open()
