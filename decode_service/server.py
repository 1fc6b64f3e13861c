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
from decode_service.inbox import KVInbox
from decode_service.lending import SegmentLender
from decode_service.metrics import decode_metrics, observe_interval, observe_step, record_sequence
from decode_service.relay import relay
from decode_service.reservations import CapacityExhausted, Reservation, ReservationState, ReservationTable
from decode_service.validation import decode_params
from engine.client import EngineClient
from engine.core import EngineCore
from engine.prompts import PrefixFeed
from engine.sequence import Sequence
from kv_wire import segments
from kv_wire.layout import KVTransferError
from kv_wire.receiver import ReceivedKV
from kv_wire.segments import SegmentPool
from model_runner.forward import warm_up
from model_runner.loading import LoadedModel
from model_runner.paged_cache import BLOCK_SIZE
from protos import decode_pb2, decode_pb2_grpc, worker_pb2
from protos.convert import model_info
from serving import logs, tracing
from serving import server as serving
from serving.tls import require_peer

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, config: DecodeConfig, runner: LoadedModel) -> None:
        spec = runner.spec
        self.config = config
        self.spec = spec
        self.kv_port = 0  # TransferKV's own port, once listening; 0: the main port
        budget = config.kv_budget_bytes(spec)
        self.table = ReservationTable(config.max_seqs, budget, spec.kv_bytes_per_token, config.lease_s)
        # Every reservation's blocks fit: the budget in whole blocks, plus a partly used last block per sequence.
        blocks = budget // (BLOCK_SIZE * spec.kv_bytes_per_token) + config.max_seqs
        self.engine = EngineCore(runner, kv_blocks=blocks, chunk_tokens=config.prefill_chunk,
                                 batch_tokens=config.prefill_batch_tokens,
                                 kv_warm_bytes=min(int(config.kv_warm_mb * (1 << 20)), budget),
                                 on_step=lambda seconds, batch: observe_step(self.metrics, seconds, batch),
                                 prompt_pass_s=config.prefill_pass_ms / 1e3, pass_steps=config.prefill_pass_steps,
                                 on_interval=lambda seconds: observe_interval(self.metrics, seconds),
                                 busy_pass_steps=config.prefill_busy_steps,
                                 busy_backlog_s=config.prefill_busy_ms / 1e3)
        self.client = EngineClient(self.engine)  # the engine thread's hops to this event loop
        keep = int(config.buffer_keep_mb * (1 << 20))
        pool = SegmentPool(keep_bytes=keep) if config.kv_shm and segments.SHM_DIR.is_dir() else None
        self.lender = SegmentLender(pool, spec.kv_bytes_per_token)
        self.metrics = decode_metrics(self.engine, self.table, self.lender)
        self.inbox = KVInbox(spec, self.table, self._admit, self.metrics, config.lease_s, config.max_chunk_bytes)

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
        try:
            reservation = self.table.reserve(params)
        except CapacityExhausted as exc:
            self.metrics.count("pdserve_rejections")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker full: {exc}")
        try:
            if params.split_tokens:  # split: the prefix's KV comes from prefill while this worker runs the rest
                reservation.feed = PrefixFeed(params.split_tokens, self.spec.num_layers)
                reservation.sequence = self._sequence(reservation, tokens=[])
                self.engine.submit_prompt(reservation.sequence, list(params.prompt), cache_salt=params.cache_salt,
                                          feed=reservation.feed)
                await self.lender.lend(reservation)
            elif params.prompt:  # colocated: prefilled here, no KV to wait for
                reservation.state = ReservationState.ADMITTED
                reservation.sequence = self._sequence(reservation, tokens=[])
                self.engine.submit_prompt(reservation.sequence, list(params.prompt), params.decoded_tokens,
                                          params.cache_salt)
            else:
                await self.lender.lend(reservation)
            lease_ms = int(self.config.lease_s * 1000)
            yield decode_pb2.DecodeEvent(reserved=decode_pb2.Reservation(
                token=reservation.token, lease_ms=lease_ms, kv_port=self.kv_port,
                shm_segment=reservation.segment.name if reservation.segment else ""))
            async for tokens in relay(reservation, context.abort, self.engine.stalled, self.config.server.stall_s,
                                      self.config.lease_s):
                if tokens is None:
                    yield decode_pb2.DecodeEvent(prefilling=decode_pb2.Prefilling())
                    continue
                token_ids, reason = tokens
                yield decode_pb2.DecodeEvent(tokens=decode_pb2.DecodedTokens(token_ids=token_ids, finish_reason=reason))
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled while grpc wrote our last event
            self.metrics.count("pdserve_cancellations")
            raise
        finally:  # done, cancelled, expired or failed: free everything this request holds
            if reservation.sequence is not None:
                self.engine.abort(reservation.sequence)
                record_sequence(self.metrics, reservation.sequence, colocated=bool(params.prompt))
                log.info("released after %d tokens (%s)", len(reservation.sequence.tokens),
                         "colocated" if params.prompt else "KV received")
            self.lender.retire(reservation)  # admitted KV took its segment already
            self.table.release(reservation)
            if reservation.transfer is not None and not reservation.transfer.done():
                reservation.transfer.cancel()  # a KV stream still arriving for a request nobody waits for

    def _admit(self, reservation: Reservation, received: ReceivedKV) -> None:
        """Step 3, for the KV inbox: the whole KV joins the batch at the next step."""
        if reservation.state is not ReservationState.TRANSFERRING:  # released while the last chunk was checked
            return  # (and its segment retired)
        release = self.lender.hand_back(reservation, received.in_segment)
        reservation.state = ReservationState.ADMITTED
        if reservation.feed is not None:  # split: every layer went to the pass already, copied out
            release()
            return
        reservation.sequence = self._sequence(reservation, tokens=[received.first_token])
        self.engine.submit_kv(reservation.sequence, received.pieces, release)

    def _sequence(self, reservation: Reservation, tokens: list[int]) -> Sequence:
        """The engine's view of a reservation; its tokens stream back through the reservation's events."""
        params = reservation.params
        return Sequence(request_id=params.request_id, prompt_len=params.prompt_tokens, max_tokens=params.max_tokens,
                        sampling=params.sampling,
                        stop_token_ids=frozenset() if params.ignore_eos else frozenset(self.spec.eos_token_ids),
                        emit=self.client.emit_to(reservation.events.put_nowait), tokens=tokens,
                        steps=[] if tracing.recording() else None, tpot_target_s=params.tpot_target_ms / 1e3)

    async def RenewLease(
        self, request: decode_pb2.LeaseRenewal, context: grpc.aio.ServicerContext
    ) -> decode_pb2.LeaseRenewed:
        await require_peer(context, "prefill", "RenewLease")
        try:
            self.table.renew(request.request_id, request.reservation_token)
        except KVTransferError as exc:
            await context.abort(exc.code, str(exc))
        return decode_pb2.LeaseRenewed(lease_ms=int(self.config.lease_s * 1000))

    async def GetInfo(
        self, request: worker_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self.engine.report_costs(worker_pb2.WorkerInfo(
            role="decode",
            model=model_info(self.spec),
            live_reservations=self.table.awaiting_kv,
            live_transfers=self.table.count(ReservationState.TRANSFERRING),
            live_sequences=self.engine.live_sequences,
            live_kv_bytes=self.table.kv_bytes,
            max_sequences=self.config.max_seqs,
            kv_budget_bytes=self.table.kv_budget_bytes,
            pid=os.getpid(),
            live_buffer_bytes=self.lender.lent_bytes,
        ))


async def serve(config: DecodeConfig) -> None:
    segments.remove_orphans()  # segments a killed worker left in /dev/shm
    runner = await asyncio.to_thread(config.model.load)
    await asyncio.to_thread(warm_up, runner)
    servicer = DecodeServicer(config, runner)
    await servicer.client.calibrate()
    servicer.engine.start()

    control, kv = control_handlers(servicer), kv_handlers(servicer)

    also, announce = None, {}
    if config.kv_port >= 0:  # TransferKV on a port of its own, which a network policy can open to prefill only
        kv_server, servicer.kv_port, kv_health = await serving.listen("decode", config.server, config.kv_port,
                                                                        registering(kv))
        also, announce = (kv_server, kv_health), {"kv": f"{config.server.host}:{servicer.kv_port}"}
    else:
        control.update(kv)

    async def shutdown() -> None:
        await servicer.client.close()
        servicer.lender.close()

    await serving.serve("decode", config.server, registering(control), shutdown, servicer.metrics, announce, also,
                        stalled=servicer.engine.stalled)
