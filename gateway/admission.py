"""Admission: at most `max_in_flight` requests run; up to `max_queue` more wait, each for `queue_timeout_s`.

Anything beyond is refused at once, with a retry hint, instead of queueing without bound: overload is turned
away early, and the requests already running keep their latency.

The places are shared fairly between clients (an API key, or a peer address where the gateway has no keys): one
client runs at most `max_in_flight_per_client` requests and queues at most `max_queue_per_client` more, and a
place that frees goes to the waiting client with the fewest requests running (the oldest request first among
equals), the way an API gateway gives each tenant its share. So a client that floods, or opens sockets that never
read, can hold its own share and no more; everyone else still finds a place.

A refusal is answered at once, up to `instant_refusals_per_client` a second for one client. A client refused
faster than that is retrying without waiting for its retry hint (a flood): each further refusal of that second is
answered after a pause (`REFUSAL_PAUSE_S`, less where the request's deadline is sooner), so the flood costs the
gateway a few refusals a second per stream instead of hundreds, and costs the flooder its own time. At most
`max_queue` refusals pause at once; past that they are answered at once again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import NoReturn

from serving.settings import check_settings, setting


class Overloaded(Exception):
    """Refused for capacity (the client is told to retry after `Admission.retry_after_ms`)."""

    def __init__(self, message: str, paused: bool = False) -> None:
        super().__init__(message)
        self.paused = paused  # answered after a pause: the client was refused too often this second


REFUSAL_PAUSE_S = 1.0  # a refusal past a client's instant ones waits this long (at most)


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = setting(64, "requests running at once; more wait in the queue", low=1)
    max_queue: int = setting(256, "requests waiting for a place; beyond it a request is refused at once with "
                             "RESOURCE_EXHAUSTED and a retry-after-ms hint", low=0)
    queue_timeout_s: float = setting(10.0, "seconds a request waits for a place, and then for decode room, before "
                                     "RESOURCE_EXHAUSTED", flag="--queue-timeout", low=0)
    # Half the running places: a single client can never take every place, and on its own it still runs as many
    # requests at once as this machine's decode batch serves well.
    max_in_flight_per_client: int = setting(
        32, "requests one client (an API key; without keys, a peer address) may run at once; more wait in the "
        "queue, where places go to the client running fewest; 0: no cap", low=0)
    max_queue_per_client: int = setting(  # a quarter of the queue
        64, "requests one client may have waiting; beyond it, RESOURCE_EXHAUSTED (HTTP 429) with a retry hint at "
        "once; 0: no cap", low=0)
    # Well above what one client behind a proxy meets at 10x overload here (~70 refusals a second in `bench
    # chaos`), well below a client that retries at once (~450 a second in `bench abuse`).
    instant_refusals_per_client: int = setting(
        100, "refusals a second one client gets at once; past that it is retrying without waiting, and each "
        "further refusal that second is answered after a pause of up to 1 s, so a flood costs the gateway little; "
        "0: never pause", low=0)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(eq=False)
class _Waiter:
    client: str
    order: int  # arrival order: the oldest first among clients with as many running
    turn: asyncio.Future[None]


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.running = 0
        self._running_by: collections.Counter[str] = collections.Counter()
        self._held_by: collections.Counter[str] = collections.Counter()  # calls cut but still open (holding())
        self._waiting: dict[str, collections.deque[_Waiter]] = {}  # client -> its waiters, oldest first
        self._queued = 0
        self._arrivals = itertools.count()
        self._refused: dict[str, tuple[float, int]] = {}  # client -> (its second's start, refusals in it)
        self.pausing = 0  # refusals waiting out their pause now

    @property
    def queued(self) -> int:
        return self._queued

    def held_by(self, client: str) -> int:
        """The client's requests running or queued, and its cut calls still open."""
        return self._running_by[client] + self._held_by[client] + len(self._waiting.get(client, ()))

    @property
    def retry_after_ms(self) -> int:
        """The hint sent with a refusal for capacity: half the queue timeout, in ms (100 when that rounds to 0)."""
        return int(self.config.queue_timeout_s * 500) or 100

    @contextlib.asynccontextmanager
    async def slot(self, deadline: float | None = None, client: str = "") -> AsyncIterator[None]:
        """Hold one of the `max_in_flight` places for the body; wait in the queue for one (bounded by the queue
        timeout and `deadline`, loop time), or raise Overloaded."""
        await self._enter(deadline, client)
        try:
            yield
        finally:
            self._leave(client)

    @contextlib.contextmanager
    def holding(self, client: str) -> Iterator[None]:
        """For the body, one of the client's places under --max-in-flight-per-client, but none of the gateway's
        --max-in-flight: a call that was cut but stays open (its client stopped reading) costs its own client, not
        everyone's share."""
        self._held_by[client] += 1
        try:
            yield
        finally:
            self._held_by[client] -= 1
            if not self._held_by[client]:
                del self._held_by[client]
            self._dispatch()

    def _under_cap(self, client: str) -> bool:
        cap = self.config.max_in_flight_per_client
        return not cap or self._running_by[client] + self._held_by[client] < cap

    async def _enter(self, deadline: float | None, client: str) -> None:
        config = self.config
        if self.running < config.max_in_flight and not self._queued and self._under_cap(client):
            self._start(client)
            return
        per_client = config.max_queue_per_client
        if per_client and len(self._waiting.get(client, ())) >= per_client:
            await self._refuse(client, deadline, f"this client has {self._running_by[client]} requests running "
                               f"and {len(self._waiting[client])} queued, the most one client may queue "
                               "(--max-queue-per-client); retry later")
        loop = asyncio.get_running_loop()
        timeout = config.queue_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - loop.time()))
        waiter = _Waiter(client, next(self._arrivals), loop.create_future())
        self._waiting.setdefault(client, collections.deque()).append(waiter)
        self._queued += 1
        self._dispatch()  # a place may be free for it (the waiters ahead are clients at their cap)
        if waiter.turn.done():
            return
        if self._queued > config.max_queue:
            self._forget(waiter)
            await self._refuse(client, deadline, f"gateway overloaded: {self.running} requests running and "
                               f"{self._queued} queued, the most it takes; retry later")
        waited = 0.0
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):  # not wait_for, which may swallow a cancel (journey.reserve)
                        await asyncio.shield(waiter.turn)
                    return
                except TimeoutError:
                    if waiter.turn.done():  # handed a place just as the wait ended: give it back to the next in line
                        self._leave(client)
                        raise
                    waited += timeout
                    # Held back only by its own client's running requests while the gateway has places free: it
                    # waits on its own client, not on anyone else, so it waits on as its deadline allows.
                    left = None if deadline is None else deadline - loop.time()
                    if (not config.queue_timeout_s or self._under_cap(client)
                            or self.running >= config.max_in_flight or (left is not None and left <= 0)):
                        raise
                    timeout = config.queue_timeout_s if left is None else min(config.queue_timeout_s, left)
        except TimeoutError:
            capped = "" if self._under_cap(client) else (
                f"; this client has {self._running_by[client]} running, the most one client may "
                "(--max-in-flight-per-client)")
            raise Overloaded(f"gateway overloaded: no place for this request within {waited:.3g} s in the "
                             f"queue{capped}; retry later") from None
        except asyncio.CancelledError:
            if waiter.turn.done():
                self._leave(client)
            raise
        finally:
            self._forget(waiter)

    async def _refuse(self, client: str, deadline: float | None, message: str) -> NoReturn:
        """Raise Overloaded(message): at once, or after a pause when the client was refused more than its instant
        refusals this second (see the module's docstring)."""
        now = asyncio.get_running_loop().time()
        start, count = self._refused.get(client, (now, 0))
        if now - start >= 1.0:
            start, count = now, 0
        if len(self._refused) >= 4 * (self.config.max_queue + 1):  # forget the clients of seconds gone by
            self._refused = {c: seen for c, seen in self._refused.items() if now - seen[0] < 1.0}
        self._refused[client] = start, count + 1
        pause = REFUSAL_PAUSE_S if deadline is None else min(REFUSAL_PAUSE_S, 0.9 * (deadline - now))
        allowance = self.config.instant_refusals_per_client
        if not allowance or count < allowance or pause <= 0 or self.pausing >= self.config.max_queue:
            raise Overloaded(message)
        self.pausing += 1
        try:
            await asyncio.sleep(pause)
        finally:
            self.pausing -= 1
        raise Overloaded(message, paused=True)

    def _start(self, client: str) -> None:
        self.running += 1
        self._running_by[client] += 1

    def _forget(self, waiter: _Waiter) -> None:
        queue = self._waiting.get(waiter.client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._queued -= 1
            if not queue:
                del self._waiting[waiter.client]

    def _leave(self, client: str) -> None:
        self.running -= 1
        self._running_by[client] -= 1
        if not self._running_by[client]:
            del self._running_by[client]
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free places to waiters: each to the client under its cap with the fewest running, oldest first."""
        while self.running < self.config.max_in_flight:
            eligible = [queue[0] for client, queue in self._waiting.items() if self._under_cap(client)]
            if not eligible:
                return
            waiter = min(eligible, key=lambda w: (self._running_by[w.client], w.order))
            self._forget(waiter)
            if not waiter.turn.done():  # its wait may have ended this very moment
                waiter.turn.set_result(None)
                self._start(waiter.client)
