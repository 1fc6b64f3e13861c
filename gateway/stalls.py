"""Bounded writes: every write of a stream to a client, gRPC or SSE, has a deadline. A write waits only once the
socket's buffers (and HTTP/2's window) are full, so a client that leaves one undrained for the stall timeout has
stopped reading: ClientStalled, and the request is cut and everything it held freed."""

from __future__ import annotations

import asyncio
import logging

import grpc
from aiohttp import web

from protos import gateway_pb2

log = logging.getLogger(__name__)

# Seconds a client may leave one write of its stream undrained. A write waits only once the kernel's socket buffers
# and HTTP/2's flow-control window (together ~100 KB to a few MB: hundreds to thousands of tokens) are full, so a
# reader that takes nothing for this long is gone or hostile; 20 s outlasts TCP's retransmission backoff over a brief
# network drop (1 + 2 + 4 + 8 s) and a mobile hand-over. nginx's send_timeout is 60 s; a held place costs more here.
DEFAULT_CLIENT_STALL_TIMEOUT_S = 20.0


class ClientStalled(Exception):
    """The client left a write of its stream undrained for the stall timeout: the request is cut, everything it held
    freed, and its transport closed (HTTP) or its status sent once the client reads again (gRPC)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the client read nothing for {timeout_s:g} s: request cut (--client-stall-timeout)")


async def grpc_write(context: grpc.aio.ServicerContext, response: gateway_pb2.GenerateResponse,
                        stall_s: float, stalled: list[asyncio.Future[None]]) -> None:
    """context.write(response); ClientStalled once the client has left it unread for `stall_s`, the write left
    pending and put in `stalled`. A cancel of the caller (the client's own cancel or disconnect) cancels the
    write, as it always did."""
    write = asyncio.ensure_future(context.write(response))
    write.add_done_callback(_retrieved)
    try:
        done, _ = await asyncio.wait({write}, timeout=stall_s)
    except asyncio.CancelledError:
        write.cancel()
        raise
    if not done:
        stalled.append(write)
        raise ClientStalled(stall_s)
    write.result()


def _retrieved(write: asyncio.Future[None]) -> None:
    """Reads a finished write's exception, so that one nobody awaited (the call ended as its handler was
    cancelled) is not logged as never retrieved."""
    if not write.cancelled():
        write.exception()


async def settled(stalled: list[asyncio.Future[None]]) -> bool:
    """Waits for a stalled write, if there is one; whether the call can still take a status (False: the call
    ended under the write, and nobody waits for one)."""
    if not stalled:
        return True
    try:
        await stalled[0]
    except Exception as ended:  # noqa: BLE001
        log.debug("a stalled stream's write ended with %r", ended)
        return False
    return True


async def sse_write(out: web.StreamResponse, data: bytes, stall_s: float) -> None:
    """One write of a stream; ClientStalled once the client leaves it undrained for `stall_s` (out.write waits only
    when the socket's buffers are full, so only a client that stopped reading ever waits here)."""
    try:
        async with asyncio.timeout(stall_s):
            await out.write(data)
    except TimeoutError:
        raise ClientStalled(stall_s) from None
