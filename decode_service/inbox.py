"""The KV inbox: TransferKV, the stream on which prefill sends a reservation's KV (server.py, step 2).

1. The header must come at once and present a live reservation's token; the stream claims the reservation.
2. Every chunk is checked as it lands (kv_wire.receiver), its bytes in the message or in the lent segment, until
   the trailer proves the KV whole. Each message renews the reservation's lease: a stream that stops moving for
   a lease is refused, however long a moving one takes.
3. The whole KV goes to `admit` (server.py, step 3), and prefill gets an acknowledgement.
Any fault refuses the stream with its status, frees the partial KV and fails the reservation's Generate stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from decode_service.reservations import Reservation, ReservationState, ReservationTable
from kv_wire import codec
from kv_wire.layout import KVTransferError, TransferState
from kv_wire.receiver import KVReceiver, ReceivedKV
from protos import kv_transfer_pb2
from protos.types import ModelSpec
from serving import logs, tracing
from serving.metrics import Metrics
from serving.tls import require_peer

log = logging.getLogger(__name__)

KV_HEADER_TIMEOUT_S = 10.0

Admit = Callable[[Reservation, ReceivedKV], None]


class KVInbox:
    def __init__(self, spec: ModelSpec, table: ReservationTable, admit: Admit, metrics: Metrics, lease_s: float,
                 max_chunk_bytes: int) -> None:
        self.spec = spec
        self.table = table
        self.admit = admit
        self.metrics = metrics
        self.lease_s = lease_s
        self.max_chunk_bytes = max_chunk_bytes

    async def TransferKV(
        self, request_iterator: AsyncIterator[codec.Received], context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.KVTransferAck:
        await require_peer(context, "prefill", "TransferKV")
        receiver = KVReceiver(self.spec, self.max_chunk_bytes)
        span = _Spans()
        started = time.perf_counter()
        try:
            return await self._transfer_kv(request_iterator, context, receiver, span)
        finally:
            span.end(receiver)
            path = span.transport or "unknown"  # no header, no path
            self.metrics.count("pdserve_kv_transfer_bytes", receiver.bytes_received, path=path)
            if receiver.state is TransferState.COMPLETE:
                self.metrics.observe("pdserve_kv_transfer_seconds", time.perf_counter() - started, path=path)
            elif receiver.failure not in (None, grpc.StatusCode.CANCELLED):  # refused or stalled, not called off
                self.metrics.count("pdserve_kv_transfer_failures", path=path)

    async def _transfer_kv(
        self, request_iterator: AsyncIterator[codec.Received], context: grpc.aio.ServicerContext,
        receiver: KVReceiver, span: _Spans,
    ) -> kv_transfer_pb2.KVTransferAck:
        reservation: Reservation | None = None
        try:
            # A stream must present its header at once (prefill opens it with the first layer's KV in hand), and
            # send each next message within the reservation's lease: a stream that sends nothing does not hold a
            # call for a lease.
            async with asyncio.timeout(min(KV_HEADER_TIMEOUT_S, self.lease_s)) as deadline:
                header = receiver.header_of(await anext(aiter(request_iterator), None))
                span.start(header)  # a child of prefill's send span: the header carries its context
                reservation = self.table.claim(header.request_id, header.reservation_token)
                reservation.transfer = asyncio.current_task()  # released mid-stream: this handler is cancelled
                deadline.reschedule(reservation.loop_expiry())
                receiver.accept_header(header, reservation.params.kv_tokens, reservation.segment)
                received = await self._receive(request_iterator, receiver, reservation, deadline)
        except KVTransferError as exc:
            await self._refuse(context, reservation, receiver, exc.code, str(exc))
        except TimeoutError:
            message = (f"KV stream stalled: no message for the {self.lease_s:g} s lease" if reservation else
                       f"KV stream stalled: no header within {min(KV_HEADER_TIMEOUT_S, self.lease_s):g} s")
            await self._refuse(context, reservation, receiver, grpc.StatusCode.DEADLINE_EXCEEDED, message)
        except asyncio.CancelledError:  # prefill went away, or the reservation was released, mid-stream
            receiver.fail(grpc.StatusCode.CANCELLED, "cancelled")  # drops the partial KV
            if reservation is not None and reservation.state is ReservationState.CLOSED and not context.cancelled():
                # Released by this worker (see Generate): end the stream with a status instead of dropping it.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                await context.abort(grpc.StatusCode.CANCELLED,
                                    f"request {reservation.params.request_id!r} was released during the transfer")
            if reservation is not None:
                reservation.fail(grpc.StatusCode.UNAVAILABLE, "KV stream from prefill was cancelled mid-transfer")
            raise
        assert reservation is not None  # claimed before any chunk was accepted
        self.admit(reservation, received)
        return kv_transfer_pb2.KVTransferAck(bytes_received=receiver.bytes_received,
                                             chunks_received=receiver.chunks_received)

    async def _receive(
        self, messages: AsyncIterator[codec.Received], receiver: KVReceiver, reservation: Reservation,
        deadline: asyncio.Timeout,
    ) -> ReceivedKV:
        fed = 0  # split prefill: layers handed to the pass so far
        async for message in messages:
            if reservation.state is not ReservationState.TRANSFERRING:
                raise receiver.fail(grpc.StatusCode.CANCELLED,
                                    f"request {reservation.params.request_id!r} was released during the transfer")
            received = receiver.accept(message)
            if received is not None:
                return received
            while reservation.feed is not None and fed < receiver.complete_layers:  # split prefill: each layer
                reservation.feed.put(fed, *receiver.layer(fed))  # goes to the pass as soon as it is whole
                fed += 1
            reservation.extend(self.lease_s)  # the stream moves: a long prompt's last pass may stream for long
            deadline.reschedule(reservation.loop_expiry())
        raise receiver.fail(grpc.StatusCode.DATA_LOSS, "KV stream ended without a trailer")

    async def _refuse(
        self, context: grpc.aio.ServicerContext, reservation: Reservation | None, receiver: KVReceiver,
        code: grpc.StatusCode, message: str,
    ) -> None:
        receiver.fail(code, message)  # drops the partial KV
        log.warning("KV transfer refused, %s: %s", code.name, message)
        if reservation is not None:
            reservation.fail(code, f"KV transfer refused: {message}")
        await context.abort(code, message)


class _Spans:
    """The KV stream's receive span, started once the header names its parent (prefill's send span)."""

    def __init__(self) -> None:
        self.span: trace.Span | None = None
        self.transport = ""

    def start(self, header: kv_transfer_pb2.KVHeader) -> None:
        logs.for_request(header.request_id)
        self.transport = "shm" if header.shm else "grpc"
        self.span = tracing.tracer.start_span(
            "kv.receive", context=tracing.incoming(dict(header.trace_context)), kind=SpanKind.SERVER,
            attributes={"pdserve.request_id": header.request_id, "pdserve.prompt_tokens": header.num_tokens,
                        "pdserve.transport": self.transport, "pdserve.dtype": header.dtype})

    def end(self, receiver: KVReceiver) -> None:
        if self.span is not None:
            self.span.set_attributes({"pdserve.kv_bytes": receiver.bytes_received,
                                      "pdserve.chunks": receiver.chunks_received,
                                      "pdserve.state": receiver.state.name})
            if receiver.state is not TransferState.COMPLETE:
                self.span.set_status(trace.Status(trace.StatusCode.ERROR, f"transfer {receiver.state.name.lower()}"))
            self.span.end()
