"""One request's journey through the workers: reserve decode -> prefill -> first token -> KV handoff -> tokens.

Yields token batches as they arrive; the caller turns them into text. Whatever ends the iteration (finish,
error, or the caller's cancellation) cancels both worker calls, and each worker frees what it held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.breakers import PairBreakers
from gateway.errors import GatewayError, NoDecodeCapacity
from gateway.messages import HopTimes
from gateway.request import GenerateParams
from gateway.workers import Pool, Worker
from protos import decode_pb2, prefill_pb2
from protos.convert import sampling_to_pb
from serving import tracing

log = logging.getLogger(__name__)


# Worker statuses worth another attempt on another worker: it died or is unreachable, its queue was full, the
# KV arrived damaged or not within decode's lease (its prefill worker died, froze or lost its way there), it
# failed inside, or it ended the call itself (CANCELLED from a worker: the gateway's own cancel never arrives as a
# status). Never: the request's own faults or a model mismatch. The client's deadline and cancel end the request
# itself, and a retry never starts past the deadline.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS,
                        grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.CANCELLED})


MIN_HEARTBEAT_MS = 50  # decode_service's floor


def kv_address(worker: str, kv_port: int) -> str:
    """Where prefill sends a reservation's KV: the decode worker's own KV port, on its host, when it has one."""
    return f"{worker.rpartition(':')[0]}:{kv_port}" if kv_port else worker


@dataclass
class Tokens:
    token_ids: list[int]
    finish_reason: str = ""  # "" while more follow


@dataclass
class Timings(HopTimes):
    """The journey's figures as it goes (HopTimes), and what only the gateway keeps."""

    cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache held
    predicted_ttft_s: float | None = None  # the model's TTFT for the last attempt's choice (None: not by the model)
    attempt_ttft_s: float | None = None  # the first token's time since that attempt began


def _hop_error(exc: grpc.aio.AioRpcError, hop: str, worker: Worker) -> GatewayError:
    return GatewayError(exc.code(), f"{hop} worker {worker.address}: {exc.details()}", worker,
                        retryable=exc.code() in _RETRYABLE)


def _cancelled_here() -> bool:
    """Whether this task is being cancelled: the request's own cancel. A CancelledError without it comes from a
    worker call cancelled under the task (grpc.aio raises it when the call's channel is closed)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _channel_closed(hop: str, worker: Worker) -> GatewayError:
    return GatewayError(grpc.StatusCode.UNAVAILABLE, f"{hop} worker {worker.address}: its channel was closed "
                        "mid-call", worker, retryable=True)


async def _read(call: grpc.aio.UnaryStreamCall, worker: Worker, hop: str) -> Any:
    """The call's next event; a failed or closed call raises GatewayError, only the request's own cancel
    raises CancelledError."""
    try:
        return await call.read()
    except grpc.aio.AioRpcError as exc:
        raise _hop_error(exc, hop, worker) from None
    except asyncio.CancelledError:
        if _cancelled_here():
            raise
        raise _channel_closed(hop, worker) from None


async def reserve(
    params: GenerateParams, pool: Pool, rpc_timeout: float | None, colocated: bool = False,
    avoid: frozenset[str] = frozenset(), idle_timeout_s: float | None = None, prefer: str = "", split: int = 0,
) -> tuple[Worker, grpc.aio.UnaryStreamCall, decode_pb2.Reservation]:
    """Open a Generate call on the first decode worker with room; its first event is the reservation.

    A worker that sends no reservation within `idle_timeout_s` is taken for frozen and the next one is asked:
    when the healthy workers are full, the frozen one (tried last) must not hold the request forever.
    Colocated, the call carries the prompt and the decode worker prefills it itself, sending a heartbeat every
    third of `idle_timeout_s` until its first token. `prefer`: the address to ask first, if it is not avoided (the
    worker the placement predicted fastest)."""
    request = decode_pb2.DecodeRequest(
        request_id=params.request_id, prompt_tokens=len(params.prompt_ids), max_tokens=params.max_tokens,
        sampling=sampling_to_pb(params.sampling), ignore_eos=params.ignore_eos,
        prompt_token_ids=params.prompt_ids if colocated else [], decoded_tokens=params.decoded if colocated else 0,
        cache_salt=params.cache_salt if colocated else "", tpot_target_ms=params.tpot_target_ms, split_tokens=split)
    if colocated and idle_timeout_s is not None:
        request.heartbeat_ms = max(MIN_HEARTBEAT_MS, int(idle_timeout_s * 1000 / 3))
    refusals: list[tuple[grpc.StatusCode, str]] = []
    ordered = pool.in_turn(avoid)
    preferred = [w for w in ordered if w.address == prefer and w.address not in avoid]
    if preferred and preferred[0] is not ordered[0]:  # in_turn counted its first as picked
        ordered[0].picked -= 1
        preferred[0].picked += 1
    for worker in preferred + [w for w in ordered if w not in preferred]:
        call = worker.stub.Generate(request, timeout=rpc_timeout, metadata=tracing.outgoing())
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a result that is ready when the task
            # is cancelled, and a Cancel call acknowledged here would let the request run to its end
            async with asyncio.timeout(idle_timeout_s):
                event = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                raise _hop_error(exc, "decode", worker) from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                worker.failed()
            refusals.append((exc.code(), exc.details() or ""))
            continue
        except (TimeoutError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and _cancelled_here():
                raise
            call.cancel()
            worker.failed()
            refusals.append((grpc.StatusCode.UNAVAILABLE, f"{worker.address}: " + (
                f"no reservation within {idle_timeout_s:g} s" if isinstance(exc, TimeoutError) else "channel closed")))
            continue
        worker.succeeded()
        if event is grpc.aio.EOF or event.WhichOneof("event") != "reserved":
            call.cancel()
            raise GatewayError(grpc.StatusCode.INTERNAL, f"decode worker {worker.address} sent no reservation",
                               worker, retryable=True)
        return worker, call, event.reserved
    if any(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in refusals):
        raise NoDecodeCapacity(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               "no decode capacity: every decode worker is full; retry later")
    raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                       "no decode worker reachable: " + "; ".join(details for _, details in refusals), retryable=True)


async def run(
    params: GenerateParams, prefill: Pool, decode: Pool, timings: Timings, rpc_timeout: float | None,
    colocated: bool = False, avoid: frozenset[str] = frozenset(), pairs: PairBreakers | None = None,
    idle_timeout_s: float | None = None, prefer: str = "", split: int = 0,
) -> AsyncGenerator[Tokens, None]:
    """The request's tokens, one attempt. Colocated, one decode worker does both phases: no prefill call, no KV
    transfer. Split (`split` > 0 prompt tokens): a prefill worker prefills the prompt's first `split` tokens and
    sends their KV to the decode worker, which prefills the rest meanwhile and samples the first token itself.
    Workers in `avoid` (addresses that failed this request before) are tried last. A decode worker silent for
    `idle_timeout_s` mid-stream, or while it prefills a colocated prompt, fails the attempt (UNAVAILABLE), so the
    stream is retried or migrates.

    Each worker's `calls` counts this attempt's call on it while it lasts: a worker that left the pool keeps
    its channel open until they end (Pool.refresh)."""
    pairs = pairs or PairBreakers()
    started = time.perf_counter()
    decode_worker, decode_call, reservation = await reserve(params, decode, rpc_timeout, colocated or bool(split),
                                                            avoid, idle_timeout_s, prefer, split)
    timings.reserve_ms = (time.perf_counter() - started) * 1e3
    decode_worker.calls += 1
    if colocated:
        timings.kv_transport = "colocated"
        try:
            async for tokens in _decoded(decode_call, decode_worker, None, idle_timeout_s=idle_timeout_s):
                yield tokens
                if tokens.finish_reason:
                    break
        finally:
            decode_call.cancel()
            decode_worker.calls -= 1
        return
    # a prefill worker whose path to this decode worker failed lately goes last, like a failed worker
    broken = frozenset(w.address for w in prefill.workers if pairs.is_open(w.address, decode_worker.address))
    # (by the prefix it may hold: never the decoded tokens of a migrated stream, which no prefill worker caches)
    prefill_worker = prefill.in_turn(avoid | broken, params.cacheable_ids, params.cache_salt)[0]
    prefill_call = prefill_worker.stub.Prefill(prefill_pb2.PrefillRequest(
        request_id=params.request_id, token_ids=params.prompt_ids[:split] if split else params.prompt_ids,
        sampling=sampling_to_pb(params.sampling),
        decode_address=kv_address(decode_worker.address, reservation.kv_port), reservation_token=reservation.token,
        shm_segment=reservation.shm_segment, decoded_tokens=params.decoded, cache_salt=params.cache_salt,
        lease_ms=reservation.lease_ms), timeout=rpc_timeout, metadata=tracing.outgoing())
    prefill_worker.calls += 1
    transfer: asyncio.Future[prefill_pb2.PrefillEvent] | None = None
    decode_read: asyncio.Future | None = None
    try:
        if split:  # the decode worker samples the first token: its stream carries every token
            transfer = asyncio.ensure_future(_prefix_sent(prefill_call, prefill_worker, timings))
        else:
            prefill_worker.prefilling_tokens += len(params.prompt_ids)  # its load, for routing, until the first token
            try:
                first, decode_read = await _first_token(prefill_call, prefill_worker, decode_call, decode_worker)
            finally:
                prefill_worker.prefilling_tokens -= len(params.prompt_ids)
            prefill_worker.succeeded()
            timings.prefill_queue_ms, timings.prefill_ms = first.first_token.queue_ms, first.first_token.forward_ms
            if not timings.migrations:  # a re-prefill after a migration has a longer prompt than the client's
                timings.cached_tokens = first.first_token.cached_tokens
            yield Tokens([first.first_token.token_id])
            transfer = asyncio.ensure_future(_prefill_event(prefill_call, prefill_worker, "transfer_done"))
        async for tokens in _decoded(decode_call, decode_worker, transfer, decode_read, idle_timeout_s):
            if tokens.finish_reason and transfer is not None:
                # The last response carries the timing. Decode finished, so it acknowledged the KV and prefill's
                # report has arrived or is on its way: wait for it briefly (a busy prefill worker can lag), and
                # record it even if it arrived between two token reads, when nothing was waiting on it.
                if not transfer.done():
                    await asyncio.wait([transfer], timeout=1.0)
                if _succeeded(transfer):
                    _record_transfer(timings, transfer.result())
                    pairs.succeeded(prefill_worker.address, decode_worker.address)
            yield tokens
            if tokens.finish_reason:
                break
    except GatewayError as exc:
        transferred = transfer is not None and _succeeded(transfer)
        if exc.retryable and not transferred and exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            pairs.failed(prefill_worker.address, decode_worker.address)  # the handoff between them broke
        raise
    finally:
        decode_call.cancel()
        prefill_call.cancel()
        for read in (transfer, decode_read):  # reads of the calls just cancelled, if still pending
            if read is not None:
                read.cancel()
        decode_worker.calls -= 1
        prefill_worker.calls -= 1


async def _prefix_sent(call: grpc.aio.UnaryStreamCall, worker: Worker, timings: Timings) -> prefill_pb2.PrefillEvent:
    """A split prompt's prefix, on its prefill worker: the token it samples after the prefix is not the request's
    (the decode worker samples that), only its times are; then the transfer's end."""
    first = await _prefill_event(call, worker, "first_token")
    timings.prefill_queue_ms, timings.prefill_ms = first.first_token.queue_ms, first.first_token.forward_ms
    return await _prefill_event(call, worker, "transfer_done")


async def _first_token(
    prefill_call: grpc.aio.UnaryStreamCall, prefill_worker: Worker,
    decode_call: grpc.aio.UnaryStreamCall, decode_worker: Worker,
) -> tuple[prefill_pb2.PrefillEvent, asyncio.Future]:
    """Prefill's first token, watching decode meanwhile: the reservation's lease ends when the prefill worker stops
    renewing it (it died, froze, or cannot reach decode), and that is the failure to retry, not the refusal of a
    transfer that comes too late. Returns the first-token event and decode's pending (or finished) read."""
    first = asyncio.ensure_future(_prefill_event(prefill_call, prefill_worker, "first_token"))
    decode_read = asyncio.ensure_future(_read(decode_call, decode_worker, "decode"))
    try:
        await asyncio.wait([first, decode_read], return_when=asyncio.FIRST_COMPLETED)
        if not first.done() and decode_read.exception() is not None:
            exc = decode_read.exception()
            if isinstance(exc, GatewayError):
                exc.suspects = (prefill_worker.address,)  # the KV never came: the prefill worker or its link too
            raise exc  # type: ignore[misc]
        return await first, decode_read  # decode's tokens may come first by a hair; prefill's token still follows
    except BaseException:
        first.cancel()
        decode_read.cancel()
        raise


async def _prefill_event(call: grpc.aio.UnaryStreamCall, worker: Worker, kind: str) -> prefill_pb2.PrefillEvent:
    event = await _read(call, worker, "prefill")
    if event is grpc.aio.EOF or event.WhichOneof("event") != kind:
        raise GatewayError(grpc.StatusCode.INTERNAL, f"prefill worker {worker.address} did not send {kind}", worker,
                           retryable=True)
    return event


def _succeeded(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _record_transfer(timings: Timings, event: prefill_pb2.PrefillEvent) -> None:
    done = event.transfer_done
    timings.kv_exposed_ms, timings.kv_transfer_ms, timings.kv_bytes = done.exposed_ms, done.transfer_ms, done.kv_bytes
    timings.kv_transport = done.transport


async def _decoded(
    call: grpc.aio.UnaryStreamCall, worker: Worker, transfer: asyncio.Future | None,
    read: asyncio.Future | None = None, idle_timeout_s: float | None = None,
) -> AsyncIterator[Tokens]:
    """Decode's token events; while the KV transfer is still open, a prefill failure ends the stream at once.

    `read` is a _read() of the call already under way; `transfer` is None for a colocated request. Once the KV
    is in (the transfer done, or none), the worker must send each event within `idle_timeout_s`; colocated, the
    first ones are the heartbeats of its own prefill, however long that queues or runs."""
    while True:
        read = read or asyncio.ensure_future(_read(call, worker, "decode"))
        try:
            await _next_event(read, transfer, worker, idle_timeout_s)
        except BaseException:
            read.cancel()
            raise
        event = read.result()
        if event is grpc.aio.EOF:
            raise GatewayError(grpc.StatusCode.INTERNAL, f"decode worker {worker.address} ended without finishing",
                               worker, retryable=True)
        read = None
        if event.WhichOneof("event") == "prefilling":  # a colocated prompt's heartbeat: alive, no token yet
            continue
        yield Tokens(list(event.tokens.token_ids), event.tokens.finish_reason)


async def _next_event(read: asyncio.Future, transfer: asyncio.Future | None, worker: Worker,
                      idle_timeout_s: float | None) -> None:
    """Wait for `read` to finish. A failed transfer fails it at once; once the transfer is done, `read` has
    `idle_timeout_s` to finish, or the worker is taken for frozen."""
    transferring = transfer is not None and not transfer.done()
    while transferring and not read.done():
        assert transfer is not None
        await asyncio.wait([read, transfer], return_when=asyncio.FIRST_COMPLETED)
        transferring = not transfer.done()
        if not transferring and not transfer.cancelled() and transfer.exception() is not None:
            raise transfer.exception()  # type: ignore[misc]
    if not read.done():
        await asyncio.wait([read], timeout=idle_timeout_s)
    if not read.done():
        raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"decode worker {worker.address} sent nothing for "
                           f"{idle_timeout_s:g} s where it owed tokens or a heartbeat: taken for frozen", worker,
                           retryable=True)
