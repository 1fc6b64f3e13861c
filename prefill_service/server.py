"""Prefill service: runs a prompt's forward pass and pushes its KV to the decode worker holding the reservation.

Life of a request here:
1. Prefill arrives from the gateway with the prompt's token ids and a decode reservation (address + token).
2. It waits in the engine's queue (engine.py): short prompts share batched passes, long ones run in chunks that
   take turns with them, and a prompt that would overflow the queue's token budget is refused. Meanwhile this
   worker renews the decode reservation's lease (RenewLease) while its engine moves, so a long queue never ends it.
3. The forward pass runs; as each layer finishes (in the prompt's last pass), its KV is handed to the event
   loop, which streams it to the decode worker (TransferKV: header, chunks, ...) while later layers still
   compute. When decode lent a shared-memory segment this worker can open (same host), the bytes go there and
   the stream carries only descriptors and checksums; a prompt with a pass to itself is computed straight into
   the segment, so its KV is not even copied.
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
import torch
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from engine.core import EngineCore
from engine.prompts import Abandoned, Prefilled, PromptJob, QueueFull
from engine.validation import check_decoded, check_prompt
from kv_wire.layout import KVLayout
from kv_wire.segments import SegmentMaps
from kv_wire.sender import KVSender
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.prefix_cache import PrefixCache
from prefill_service.config import PrefillConfig
from prefill_service.kv_push import DecodeChannels, KVPush
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2
from protos.convert import model_info, sampling_from_pb
from protos.types import SamplingParams, check_cache_salt
from serving import logs, tracing
from serving import server as serving
from serving.metrics import Metrics
from serving.server import (
    CHANNEL_KEEPALIVE,
    MESSAGE_LIMITS,
)
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
        self._channels = DecodeChannels(lambda address: aio_channel(
            address, config.server.tls, [*MESSAGE_LIMITS, *CHANNEL_KEEPALIVE], expect="decode"))
        self._segments = SegmentMaps()
        self.metrics = Metrics(
            gauges={"pdserve_live_prefills": ("prompts queued or running", lambda: self.engine.live_jobs),
                    "pdserve_queued_tokens": ("prompt tokens queued or running", lambda: self.engine.queued_tokens),
                    "pdserve_num_requests_waiting": ("prompts queued", lambda: self.engine.waiting),
                    "pdserve_num_requests_running": ("prompts in the forward pass under way",
                                                     lambda: self.engine.live_jobs - self.engine.waiting),
                    "pdserve_mapped_segment_bytes": ("decode workers' shared-memory segments mapped here, for reuse",
                                                     lambda: self._segments.mapped_bytes),
                    "pdserve_prefix_cache_bytes": ("KV bytes held by the prefix cache",
                                                   lambda: self.prefix_cache.bytes if self.prefix_cache else 0),
                    "pdserve_prefix_cache_pool_bytes": (
                        "the prefix cache's pool as far as it has been written (resident; at most --prefix-cache-mb)",
                        lambda: self.prefix_cache.pool_bytes if self.prefix_cache else 0),
                    "pdserve_prefix_cache_blocks": ("prefix blocks cached",
                                                    lambda: len(self.prefix_cache) if self.prefix_cache else 0)},
            counters={"pdserve_cancellations": "prefills whose caller cancelled or left mid-request",
                      "pdserve_rejections": "prompts refused: the queue's token budget was full",
                      "pdserve_prompt_tokens": "prompt tokens prefilled",
                      "pdserve_prefill_computed_tokens": "prompt tokens the forward pass ran (cached ones excluded)",
                      "pdserve_prefix_cache_queries": "prompt tokens looked up in the prefix cache",
                      "pdserve_prefix_cache_hits": "prompt tokens whose KV the prefix cache held",
                      "pdserve_kv_transfer_bytes": "KV bytes sent, by path (grpc, shm)",
                      "pdserve_kv_transfer_failures": "KV transfers refused or broken, by path"},
            histograms={"pdserve_request_queue_time_seconds": "arrival to the prompt's first forward pass",
                        "pdserve_request_prefill_time_seconds": "the prompt's forward passes, first to last",
                        "pdserve_kv_transfer_seconds": "first KV layer sent to decode's acknowledgement, by path"})

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
        token_ids, sampling = await self._validate(request, context)
        loop = asyncio.get_running_loop()
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

        def deliver(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # engine thread
            loop.call_soon_threadsafe(push.deliver, (layer, keys, values))

        result: asyncio.Future[Prefilled] = loop.create_future()

        def finish(outcome: Prefilled | BaseException) -> None:  # engine thread
            loop.call_soon_threadsafe(_settle, result, outcome)

        job = PromptJob(token_ids, sampling, deliver, finish, abandon, kv_home=home, decoded=request.decoded_tokens,
                        cache_salt=request.cache_salt)
        arrived = time.perf_counter()
        renewing: asyncio.Future | None = None
        try:
            try:
                self.engine.submit(job)
            except QueueFull as exc:
                self.metrics.count("pdserve_rejections")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except Abandoned as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if request.lease_ms:
                renewing = asyncio.ensure_future(self._renew_lease(request, push, result))
            try:
                prefilled = await result
            except Abandoned:
                await self._transfer_result(push, request.decode_address, context)  # raises decode's refusal
                raise
            except Exception as exc:  # its pass, or sampling its first token, failed: logged by the engine
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(exc).__name__}: {exc}")
            started, ended = prefilled.started, prefilled.ended
            self._record(arrived, prefilled, len(token_ids))
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

    def _record(self, arrived: float, prefilled: Prefilled, prompt_tokens: int) -> None:
        """The prompt's wait and forward passes: child spans of the current (prefill) span, and histograms."""
        cached = prefilled.cached_tokens
        tracing.record("prefill.queue", None, arrived, prefilled.started)
        tracing.record("prefill.forward", None, prefilled.started, prefilled.ended,
                       {"pdserve.batch_size": prefilled.batch_size, "pdserve.passes": prefilled.passes,
                        "pdserve.prompt_tokens": prompt_tokens, "pdserve.cached_tokens": cached})
        span = trace.get_current_span()
        span.set_attributes({"pdserve.cached_tokens": cached, "pdserve.prefix_cache": "hit" if cached else "miss"})
        self.metrics.observe("pdserve_request_queue_time_seconds", prefilled.started - arrived)
        self.metrics.observe("pdserve_request_prefill_time_seconds", prefilled.ended - prefilled.started)
        self.metrics.count("pdserve_prompt_tokens", prompt_tokens)
        self.metrics.count("pdserve_prefill_computed_tokens", prompt_tokens - cached)
        if self.prefix_cache is not None:
            self.metrics.count("pdserve_prefix_cache_queries", prompt_tokens)
            self.metrics.count("pdserve_prefix_cache_hits", cached)

    async def _renew_lease(self, request: prefill_pb2.PrefillRequest, push: KVPush, result: asyncio.Future) -> None:
        """Step 2's wait may outlast decode's lease: renew it at once (the lease began at decode's reservation,
        before this call reached prefill) and then every third of a lease until the KV stream opens (its messages
        renew it then), while the engine moves. A frozen or stuck worker (past the watchdog's --stall-s) stops
        renewing, so the lease still ends when no KV can come."""
        period = request.lease_ms / 3e3
        renewal = decode_pb2.LeaseRenewal(request_id=request.request_id, reservation_token=request.reservation_token)
        stub = decode_pb2_grpc.DecodeStub(self._channels.acquire(request.decode_address))
        try:
            while not (result.done() or push.call is not None):
                if self.engine.stalled() <= self.config.server.stall_s:
                    try:  # a renewal that lands late still extends the lease: wait for it up to a whole lease
                        await stub.RenewLease(renewal, timeout=request.lease_ms / 1e3)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
                            return  # released or expired: decode fails the request, and the gateway cancels this
                        log.warning("renewing the lease at decode worker %s failed, %s: %s",
                                    request.decode_address, exc.code().name, exc.details())
                await asyncio.sleep(period)
        finally:
            self._channels.release(request.decode_address)

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

    async def _validate(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> tuple[list[int], SamplingParams]:
        token_ids = list(request.token_ids)
        try:
            check_prompt(self.spec, len(token_ids), 1, token_ids)  # the one token prefill generates: the first
            check_decoded(len(token_ids), request.decoded_tokens)
            check_cache_salt(request.cache_salt)
            if not request.decode_address or not request.reservation_token:
                raise ValueError("decode_address and reservation_token are required")
            sampling = sampling_from_pb(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return token_ids, sampling

    def _channel(self, address: str) -> grpc.aio.Channel:
        """The channel to the decode worker a request in _prefill acquired, for its other calls to it."""
        return self._channels.held(address)

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
        await asyncio.to_thread(self.engine.close)


def _settle(result: asyncio.Future[Prefilled], outcome: Prefilled | BaseException) -> None:
    if result.done():  # the handler already left
        return
    if isinstance(outcome, BaseException):
        result.set_exception(outcome)
    else:
        result.set_result(outcome)


async def serve(config: PrefillConfig) -> None:
    runner = await asyncio.to_thread(config.model.load)
    await asyncio.to_thread(forward.warm_up, runner)
    servicer = PrefillServicer(config, runner)
    await asyncio.to_thread(servicer.engine.calibrate)

    def register(server: grpc.aio.Server) -> list[str]:
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        return [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name]

    await serving.serve("prefill", config.server, register, servicer.close, servicer.metrics,
                        stalled=servicer.engine.stalled)
