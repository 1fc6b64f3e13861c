"""Admission: at most `max_in_flight` requests run; up to `max_queue` more wait, each for `queue_timeout_s`.

Anything beyond is refused at once, with a retry hint, instead of queueing without bound: overload is turned
away early, and the requests already running keep their latency.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass


class Overloaded(Exception):
    """Refused for capacity (the client is told to retry after `Admission.retry_after_ms`)."""


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = 64
    max_queue: int = 256
    queue_timeout_s: float = 10.0


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.running = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def retry_after_ms(self) -> int:
        """The hint sent with a refusal for capacity: half the queue timeout, in ms (100 when that rounds to 0)."""
        return int(self.config.queue_timeout_s * 500) or 100

    @contextlib.asynccontextmanager
    async def slot(self, deadline: float | None = None) -> AsyncIterator[None]:
        """Hold one of the `max_in_flight` places for the body; wait in the queue for one (bounded by the queue
        timeout and `deadline`, loop time), or raise Overloaded."""
        await self._enter(deadline)
        try:
            yield
        finally:
            self._leave()

    async def _enter(self, deadline: float | None) -> None:
        config = self.config
        if self.running < config.max_in_flight and not self._waiting:
            self.running += 1
            return
        if len(self._waiting) >= config.max_queue:
            raise Overloaded(f"gateway overloaded: {self.running} requests running and {len(self._waiting)} "
                             "queued, the most it takes; retry later")
        loop = asyncio.get_running_loop()
        timeout = config.queue_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - loop.time()))
        turn: asyncio.Future[None] = loop.create_future()
        self._waiting.append(turn)
        try:
            async with asyncio.timeout(timeout):  # not wait_for, which may swallow a cancel (journey.reserve)
                await asyncio.shield(turn)
        except TimeoutError:
            if turn.done():  # handed a place just as the wait ended: give it back to the next in line
                self._leave()
            raise Overloaded(f"gateway overloaded: no place for this request within {timeout:.3g} s in the "
                             "queue; retry later") from None
        except asyncio.CancelledError:
            if turn.done():
                self._leave()
            raise
        finally:
            if turn in self._waiting:
                self._waiting.remove(turn)

    def _leave(self) -> None:
        while self._waiting:  # hand the place straight to the oldest waiter still waiting
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1
