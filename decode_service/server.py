"""Decode service: reserves capacity, receives a request's KV from prefill, and streams its tokens.

Life of a request here:
1. Generate arrives from the gateway and is checked (validation.py); a slot and KV budget are reserved
   (reservations.py), the reservation (token + lease) is the stream's first event. No capacity:
   RESOURCE_EXHAUSTED, nothing held. The reservation also lends a shared-memory segment that a prefill worker on
   the same host may write the KV into (lending.py). While the prompt waits in prefill's queue, the prefill
   worker renews the lease (RenewLease): only a prefill worker that died, froze or lost its way here lets it run
   out.
2. TransferKV arrives from prefill (the KV inbox, inbox.py): the header must present the reservation's token;
   every chunk is checked as it lands (its bytes in the message, or in the lent segment). Any fault refuses the
   stream with its status, frees the partial KV, and fails step 1's stream.
3. The whole KV validated: the sequence joins the engine's continuous batch at the next step.
4. Each step's token reaches this event loop (engine/client.py) and goes out on the Generate stream (relay.py);
   eos, max_tokens or the context limit end it.
5. The Generate call ending for any reason (done, gateway cancel, lease expiry, failure) frees everything.

A colocated request (DecodeRequest.prompt_token_ids) skips steps 2-3: after the reservation, the engine
prefills the prompt itself in chunks between decode steps, and the first token comes from this worker; until it
does, a `prefilling` event every heartbeat_ms tells the gateway this worker is alive and its engine moving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry.trace import SpanKind

from decode_service.config import DecodeConfig
from decode_service.handlers import control_handlers, kv_handlers, registering
from decode_service.relay import relay
from decode_service.reservations import CapacityExhausted, ReservationState
from decode_service.validation import decode_params
from decode_service.worker import DecodeWorker
from kv_wire import segments
from kv_wire.layout import KVTransferError
from model_runner.forward import warm_up
from model_runner.loading import LoadedModel
from protos import decode_pb2, decode_pb2_grpc, worker_pb2
from protos.convert import model_info
from serving import logs, tracing
from serving import server as serving
from serving.tls import require_peer

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """The proto edge of a DecodeWorker (worker.py)."""

    def __init__(self, config: DecodeConfig, runner: LoadedModel) -> None:
        self.config = config
        self.spec = runner.spec
        self.kv_port = 0  # TransferKV's own port, once listening; 0: the main port
        self.worker = DecodeWorker(config, runner)
        self.inbox = self.worker.inbox  # TransferKV's handler (handlers.py)

    async def Generate(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeEvent]:
        with tracing.tracer.start_as_current_span(
            "decode", context=tracing.incoming(context.invocation_metadata()), kind=SpanKind.SERVER,
            attributes={"pdserve.request_id": request.request_id, "pdserve.prompt_tokens": request.prompt_tokens,
                        "pdserve.colocated": bool(request.prompt_token_ids)},
        ) as span:
            logs.for_request(request.request_id)
            await require_peer(context, "gateway", "Generate (a decode reservation)")
            generated = 0
            try:  # aclosing: when grpc drops this generator, _generate frees the request now, not at GC
                async with contextlib.aclosing(self._generate(request, context)) as events:
                    async for event in events:
                        kind = event.WhichOneof("event")
                        if kind == "reserved":
                            span.add_event("reserved")
                        elif kind == "tokens":
                            generated += len(event.tokens.token_ids)
                            if event.tokens.finish_reason:
                                span.set_attribute("pdserve.finish_reason", event.tokens.finish_reason)
                        yield event
            finally:  # once, not per token
                span.set_attribute("pdserve.output_tokens", generated)

    async def _generate(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[decode_pb2.DecodeEvent, None]:
        try:
            params = decode_params(self.spec, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        worker = self.worker
        try:
            reservation = worker.table.reserve(params)
        except CapacityExhausted as exc:
            worker.metrics.count("pdserve_rejections")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker full: {exc}")
        # The call's end frees the request too, whatever keeps the stream's own cleanup from running (a stream
        # dropped unclosed waits for the collector; a soak once saw a reservation held past its call's end).
        context.add_done_callback(lambda _: worker.release(reservation))
        try:
            await worker.start(reservation)
            yield decode_pb2.DecodeEvent(reserved=decode_pb2.Reservation(
                token=reservation.token, lease_ms=int(self.config.lease_s * 1000), kv_port=self.kv_port,
                shm_segment=reservation.segment.name if reservation.segment else ""))
            async for tokens in relay(reservation, context.abort, worker.engine.stalled, self.config.server.stall_s,
                                      self.config.lease_s):
                if tokens is None:
                    yield decode_pb2.DecodeEvent(prefilling=decode_pb2.Prefilling())
                    continue
                token_ids, reason = tokens
                yield decode_pb2.DecodeEvent(tokens=decode_pb2.DecodedTokens(token_ids=token_ids, finish_reason=reason))
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled while grpc wrote our last event
            worker.metrics.count("pdserve_cancellations")
            raise
        finally:  # done, cancelled, expired or failed: free everything this request holds
            worker.release(reservation)

    async def RenewLease(
        self, request: decode_pb2.LeaseRenewal, context: grpc.aio.ServicerContext
    ) -> decode_pb2.LeaseRenewed:
        await require_peer(context, "prefill", "RenewLease")
        try:
            self.worker.table.renew(request.request_id, request.reservation_token)
        except KVTransferError as exc:
            await context.abort(exc.code, str(exc))
        return decode_pb2.LeaseRenewed(lease_ms=int(self.config.lease_s * 1000))

    async def GetInfo(
        self, request: worker_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        table = self.worker.table
        return self.worker.engine.report_costs(worker_pb2.WorkerInfo(
            role="decode", model=model_info(self.spec), live_reservations=table.awaiting_kv,
            live_transfers=table.count(ReservationState.TRANSFERRING), live_sequences=self.worker.engine.live_sequences,
            live_kv_bytes=table.kv_bytes, max_sequences=self.config.max_seqs, kv_budget_bytes=table.kv_budget_bytes,
            pid=os.getpid(), live_buffer_bytes=self.worker.lender.lent_bytes))


async def serve(config: DecodeConfig) -> None:
    segments.remove_orphans()  # segments a killed worker left in /dev/shm
    runner = await asyncio.to_thread(config.model.load)
    await asyncio.to_thread(warm_up, runner)
    servicer = DecodeServicer(config, runner)
    worker = servicer.worker
    await worker.client.calibrate()
    worker.engine.start()

    control, kv = control_handlers(servicer), kv_handlers(servicer)

    also, announce = None, {}
    if config.kv_port >= 0:  # TransferKV on a port of its own, which a network policy can open to prefill only
        kv_server, servicer.kv_port, kv_health = await serving.listen("decode", config.server, config.kv_port,
                                                                        registering(kv))
        also, announce = (kv_server, kv_health), {"kv": f"{config.server.host}:{servicer.kv_port}"}
    else:
        control.update(kv)

    await serving.serve("decode", config.server, registering(control), worker.close, worker.metrics, announce, also,
                        stalled=worker.engine.stalled)
