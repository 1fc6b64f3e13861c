"""Renewing a decode reservation's lease while its prompt waits in this worker's queue (step 2 in server.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from prefill_service.kv_push import DecodeChannels, KVPush
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2

log = logging.getLogger(__name__)


async def renew_lease(request: prefill_pb2.PrefillRequest, channels: DecodeChannels, push: KVPush,
                      result: asyncio.Future, stalled: Callable[[], float], stall_s: float) -> None:
    """Step 2's wait may outlast decode's lease: renew it at once (the lease began at decode's reservation,
    before this call reached prefill) and then every third of a lease until the KV stream opens (its messages
    renew it then) or `result` (the prompt's outcome) is in, while the engine moves. A frozen or stuck worker
    (`stalled()` past the watchdog's `stall_s`) stops renewing, so the lease still ends when no KV can come."""
    period = request.lease_ms / 3e3
    renewal = decode_pb2.LeaseRenewal(request_id=request.request_id, reservation_token=request.reservation_token)
    stub = decode_pb2_grpc.DecodeStub(channels.acquire(request.decode_address))
    try:
        while not (result.done() or push.call is not None):
            if stalled() <= stall_s:
                try:  # a renewal that lands late still extends the lease: wait for it up to a whole lease
                    await stub.RenewLease(renewal, timeout=request.lease_ms / 1e3)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
                        return  # released or expired: decode fails the request, and the gateway cancels this
                    log.warning("renewing the lease at decode worker %s failed, %s: %s",
                                request.decode_address, exc.code().name, exc.details())
            await asyncio.sleep(period)
    finally:
        channels.release(request.decode_address)
