"""Prefill service: runs a prompt's forward pass and pushes its KV to the decode worker holding the reservation.

Life of a request here:
1. Prefill arrives from the gateway with the prompt's token ids and a decode reservation (address + token).
2. It waits in the engine's queue (engine/prompts.py): short prompts share batched passes, long ones run in chunks
   that take turns with them, and a prompt that would overflow the queue's token budget is refused. Meanwhile this
   worker renews the decode reservation's lease (RenewLease, lease.py) while its engine moves, so a long queue never
   ends it.
3. The forward pass runs; as each layer finishes (in the prompt's last pass), its KV is handed to the event
   loop (engine/client.py), which streams it to the decode worker (TransferKV: header, chunks, ...; kv_push.py)
   while later layers still compute. When decode lent a shared-memory segment this worker can open (same host),
   the bytes go there and the stream carries only descriptors and checksums; a prompt with a pass to itself is
   computed straight into the segment, so its KV is not even copied.
4. The first token is sampled from the last position and sent to the gateway at once (TTFT does not wait for
   the transfer); the KV stream is closed with a trailer that carries it.
5. Decode acknowledges: the call ends with TransferDone. A refused transfer ends the call with decode's status;
   a cancelled call stops the forward pass at the next layer and sends nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from engine.client import EngineClient
from engine.core import EngineCore
from engine.prompts import Abandoned, QueueFull
from kv_wire.layout import KVLayout
from kv_wire.segments import SegmentMaps
from kv_wire.sender import KVSender
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.prefix_cache import PrefixCache
from prefill_service.config import PrefillConfig
from prefill_service.kv_push import DecodeChannels, KVPush
from prefill_service.lease import renew_lease
from prefill_service.metrics import prefill_metrics, record_prefill
from prefill_service.validation import checked_prompt
from protos import prefill_pb2, prefill_pb2_grpc, worker_pb2
from protos.convert import model_info
from serving import logs, tracing
from serving import server as serving
from serving.server import CHANNEL_KEEPALIVE, MESSAGE_LIMITS
from serving.tls import aio_channel, require_peer

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillConfig, runner: LoadedModel) -> None:
        self.config = config
        self.runner = runner
        self.spec = runner.spec
        self.prefix_cache = None
        if config.prefix_cache_mb:
            self.prefix_cache = PrefixCache(config.prefix_block_tokens, int(config.prefix_cache_mb * (1 << 20)))
        self.engine = EngineCore(runner, batch_tokens=config.batch_tokens, chunk_tokens=config.prefill_chunk,
                                 max_queued_tokens=config.max_queued_tokens, layer_streaming=config.layer_streaming,
                                 prefix_cache=self.prefix_cache)
        self.engine.start()
        self.client = EngineClient(self.engine)  # the engine thread's hops to this event loop
        self._channels = DecodeChannels(lambda address: aio_channel(
            address, config.server.tls, [*MESSAGE_LIMITS, *CHANNEL_KEEPALIVE], expect="decode"))
        self._segments = SegmentMaps()
        self.metrics = prefill_metrics(self.engine, self._segments, self.prefix_cache)

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PrefillEvent]:
        with tracing.tracer.start_as_current_span(
            "prefill", context=tracing.incoming(context.invocation_metadata()), kind=SpanKind.SERVER,
            attributes={"pdserve.request_id": request.request_id, "pdserve.prompt_tokens": len(request.token_ids),
                        "pdserve.decode_address": request.decode_address},
        ) as span:
            logs.for_request(request.request_id)
            await require_peer(context, "gateway", "Prefill")
            # aclosing: when grpc drops this generator, _prefill stops its work now, not at GC
            async with contextlib.aclosing(self._prefill(request, context)) as events:
                async for event in events:
                    if event.WhichOneof("event") == "first_token":
                        span.add_event("first token", {"pdserve.queue_ms": event.first_token.queue_ms,
                                                       "pdserve.forward_ms": event.first_token.forward_ms})
                    yield event

    async def _prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[prefill_pb2.PrefillEvent, None]:
        try:
            token_ids, sampling = checked_prompt(self.spec, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        spec = self.spec
        layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, len(token_ids),
                          self.config.wire_dtype or spec.dtype)
        segment = home = None
        if self.config.kv_shm and request.shm_segment:
            segment = self._segments.open(request.shm_segment, request.reservation_token, layout.total_bytes)
        if segment is not None and layout.dtype == spec.dtype and self.runner.device.type == "cpu":
            home = segment.tensors(layout)  # the forward pass writes the KV straight into decode's segment
        send_span = tracing.tracer.start_span("kv.send", kind=SpanKind.CLIENT)
        with trace.use_span(send_span):  # the KV header carries this span's context to decode's receive span
            sender = KVSender(request.request_id, request.reservation_token, spec.fingerprint, layout,
                              self.config.chunk_bytes, trace_context=tracing.carrier(), segment=segment)
        abandon = threading.Event()
        push = KVPush(self._channels.acquire(request.decode_address), sender, abandon)  # released in finally
        arrived = time.perf_counter()
        renewing: asyncio.Future | None = None
        try:
            try:
                result = self.client.prefill(token_ids, sampling, push.deliver, abandon, kv_home=home,
                                             decoded=request.decoded_tokens, cache_salt=request.cache_salt)
            except QueueFull as exc:
                self.metrics.count("pdserve_rejections")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except Abandoned as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if request.lease_ms:
                renewing = asyncio.ensure_future(renew_lease(request, self._channels, push, result,
                                                             self.engine.stalled, self.config.server.stall_s))
            try:
                prefilled = await result
            except Abandoned:
                await self._transfer_result(push, request.decode_address, context)  # raises decode's refusal
                raise
            except Exception as exc:  # its pass, or sampling its first token, failed: logged by the engine
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(exc).__name__}: {exc}")
            started, ended = prefilled.started, prefilled.ended
            record_prefill(self.metrics, arrived, prefilled, len(token_ids), self.prefix_cache)
            yield prefill_pb2.PrefillEvent(first_token=prefill_pb2.FirstToken(
                token_id=prefilled.first_token, queue_ms=(started - arrived) * 1e3,
                forward_ms=(ended - started) * 1e3, cached_tokens=prefilled.cached_tokens))
            push.deliver(prefilled.first_token)
            await self._transfer_result(push, request.decode_address, context)
            done = time.perf_counter()
            self.metrics.observe("pdserve_kv_transfer_seconds", done - push.started_at, path=sender.transport)
            log.info("prefilled %d tokens (%d cached): queue %.1f ms, forward %.1f ms; KV %d bytes by %s, %.1f ms "
                     "exposed", len(token_ids), prefilled.cached_tokens, (started - arrived) * 1e3,
                     (ended - started) * 1e3, sender.bytes_sent, sender.transport, (done - ended) * 1e3)
            yield prefill_pb2.PrefillEvent(transfer_done=prefill_pb2.TransferDone(
                kv_bytes=sender.bytes_sent, chunks=sender.chunks_sent,
                exposed_ms=(done - ended) * 1e3, transfer_ms=(done - push.started_at) * 1e3,
                transport=sender.transport))
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled while grpc wrote an event
            self.metrics.count("pdserve_cancellations")
            raise
        finally:  # finished, refused, cancelled or failed: stop computing, stop sending, end the span
            if renewing is not None:
                renewing.cancel()
            abandon.set()
            self.engine.wake()
            push.cancel()
            self._channels.release(request.decode_address)
            self._segments.prune()  # a segment decode retired (a cancel, a retry) is let go now, not at eviction
            send_span.set_attributes({"pdserve.kv_bytes": sender.bytes_sent, "pdserve.chunks": sender.chunks_sent,
                                      "pdserve.transport": sender.transport, "pdserve.state": sender.state.name})
            send_span.end()
            self.metrics.count("pdserve_kv_transfer_bytes", sender.bytes_sent, path=sender.transport)

    async def _transfer_result(self, push: KVPush, address: str, context: grpc.aio.ServicerContext) -> None:
        """Wait for decode's acknowledgement; a refused or broken transfer ends this call with its status."""
        if push.call is None:
            await context.abort(grpc.StatusCode.CANCELLED, "the request ended before its KV was sent")
            return
        try:
            await push.call
        except grpc.aio.AioRpcError as exc:
            self.metrics.count("pdserve_kv_transfer_failures", path=push.sender.transport)
            log.warning("KV transfer to %s failed, %s: %s", address, exc.code().name, exc.details())
            await context.abort(exc.code(), f"KV transfer to decode worker {address} failed: {exc.details()}")
        except asyncio.CancelledError:
            if not push.call.cancelled():  # this handler itself is being cancelled
                raise
            self.metrics.count("pdserve_kv_transfer_failures", path=push.sender.transport)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer to decode worker {address} was cancelled")

    async def GetInfo(
        self, request: worker_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self.engine.report_costs(worker_pb2.WorkerInfo(
            role="prefill", model=model_info(self.spec), live_sequences=self.engine.live_jobs,
            queued_tokens=self.engine.queued_tokens, pid=os.getpid(),
            prefix_block_tokens=self.config.prefix_block_tokens))

    async def close(self) -> None:
        await self._channels.close()
        self._segments.close()
        await self.client.close()


async def serve(config: PrefillConfig) -> None:
    runner = await asyncio.to_thread(config.model.load)
    await asyncio.to_thread(forward.warm_up, runner)
    servicer = PrefillServicer(config, runner)
    await servicer.client.calibrate()

    def register(server: grpc.aio.Server) -> list[str]:
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        return [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name]

    await serving.serve("prefill", config.server, register, servicer.close, servicer.metrics,
                        stalled=servicer.engine.stalled)
