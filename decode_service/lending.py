"""Segment lending: the shared-memory segment a reservation lends to a prefill worker on the same host.

1. A reservation (server.py, step 1) borrows a segment from the pool and stamps it with its token; prefill
   writes only into a segment stamped for its own request, and checks the stamp between layers.
2. Admitted KV (step 3): the stamp is wiped and the segment goes back to the pool, at once if the KV came over
   gRPC, else once the KV was read out of it into the batch.
3. Any other ending: a writer may still hold the segment (stopped, or between two stamp checks), so the segment
   is retired, never lent again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from decode_service.reservations import Reservation
from kv_wire import segments
from kv_wire.segments import Segment, SegmentPool

log = logging.getLogger(__name__)


class SegmentLender:
    """Lends the pool's segments to reservations; no pool (no /dev/shm, or --no-kv-shm) lends nothing."""

    def __init__(self, pool: SegmentPool | None, kv_bytes_per_token: int) -> None:
        self.pool = pool
        self.kv_bytes_per_token = kv_bytes_per_token

    @property
    def lent_bytes(self) -> int:
        return self.pool.held_bytes if self.pool else 0

    async def lend(self, reservation: Reservation) -> None:
        if self.pool is None:
            return
        pool = self.pool
        acquiring = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
            pool.maker, pool.acquire, reservation.params.kv_tokens * self.kv_bytes_per_token))
        try:
            segment = await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            # The request ended while the segment was being made; the thread still finishes: take it back then.
            def give_back(done: asyncio.Future[Segment]) -> None:
                if not done.cancelled() and done.exception() is None:
                    pool.release(done.result())

            acquiring.add_done_callback(give_back)
            raise
        except OSError as exc:  # /dev/shm full or unavailable: this request's KV comes over gRPC
            log.warning("no shared-memory segment for request %r: %s", reservation.params.request_id, exc)
            return
        segments.stamp(segment, reservation.token)
        reservation.segment = segment

    def hand_back(self, reservation: Reservation, kv_in_segment: bool) -> Callable[[], None]:
        """The reservation's KV is admitted: its segment goes back to the pool, now if the KV came over gRPC,
        else when the returned function is called (the KV is read from the segment until it joins the batch)."""
        segment, pool = self._take_back(reservation), self.pool
        if segment is None or pool is None:
            return _nothing  # gRPC: the messages go with the last reference to them
        if kv_in_segment:  # the writer is done
            return functools.partial(pool.release, segment)
        pool.release(segment)  # lent but not written
        return _nothing

    def retire(self, reservation: Reservation) -> None:
        """A reservation ended without its KV admitted: a prefill worker may still be writing into its segment
        (stopped, or between two stamp checks), so the segment is removed, never lent again."""
        segment = self._take_back(reservation)
        if segment is not None and self.pool is not None:
            self.pool.discard(segment)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _take_back(self, reservation: Reservation) -> Segment | None:
        """Unstamp the reservation's segment (a writer checks the stamp between layers) and hand it over."""
        segment, reservation.segment = reservation.segment, None
        if segment is not None:
            segments.stamp(segment, None)
        return segment


def _nothing() -> None:
    pass
