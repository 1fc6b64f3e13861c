"""What a reservation's Generate stream relays (server.py, step 4): its tokens in batches, as the engine emits
them onto the reservation's queue (engine/client.py), a heartbeat while a colocated prompt prefills, and a
failure, or KV that never came, as the call's status."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc

from decode_service.reservations import Failure, Reservation, ReservationState
from engine.sequence import FAILED

log = logging.getLogger(__name__)

Abort = Callable[[grpc.StatusCode, str], Awaitable[NoReturn]]  # the call's ServicerContext.abort


async def relay(reservation: Reservation, abort: Abort, stalled: Callable[[], float], stall_s: float,
                lease_s: float) -> AsyncIterator[tuple[list[int], str] | None]:
    """The reservation's tokens, in batches; None for a heartbeat while a colocated prompt prefills. A heartbeat
    is skipped while the engine has been inside one iteration (`stalled()`) for `stall_s` or more."""
    heartbeat_s = reservation.params.heartbeat_ms / 1e3 or None
    while True:
        if reservation.state is ReservationState.ADMITTED:
            try:
                async with asyncio.timeout(heartbeat_s):
                    event = await reservation.events.get()
            except TimeoutError:
                if stalled() < stall_s:  # a stuck engine sends none
                    yield None
                continue
        else:
            try:
                async with asyncio.timeout_at(reservation.loop_expiry()):
                    event = await reservation.events.get()
            except TimeoutError:
                # the KV arrived just in time (tokens follow), or prefill renewed the lease meanwhile
                if reservation.state is ReservationState.ADMITTED or time.monotonic() < reservation.expires_at:
                    continue
                message = (f"KV for request {reservation.params.request_id!r} did not arrive, nor did prefill renew "
                           f"the {lease_s:g} s lease")
                log.warning("%s: reservation released (%s)", message, reservation.state.value)
                await abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
        if isinstance(event, Failure):
            await abort(event.code, event.message)
            return
        token_ids, reason = event
        while not reason and not reservation.events.empty():  # coalesce tokens the client has not seen yet
            more = reservation.events.get_nowait()
            if isinstance(more, Failure):
                await abort(more.code, more.message)
                return
            token_ids, reason = token_ids + more[0], more[1]
        if reason == FAILED:
            await abort(grpc.StatusCode.INTERNAL, "decode engine failed this sequence; see worker logs")
        heartbeat_s = None  # the first token is out: decode steps follow
        yield token_ids, reason
        if reason:
            return
