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
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry.trace import SpanKind

from engine.prompts import Abandoned, QueueFull
from model_runner import forward
from model_runner.loading import LoadedModel
from prefill_service.config import PrefillConfig
from prefill_service.kv_push import KVPush
from prefill_service.lease import renew_lease
from prefill_service.metrics import record_prefill
from prefill_service.validation import checked_prompt
from prefill_service.worker import PrefillWorker
from protos import prefill_pb2, prefill_pb2_grpc, worker_pb2
from protos.convert import model_info
from serving import logs, tracing
from serving import server as serving
from serving.tls import require_peer

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """The proto edge of a PrefillWorker (worker.py)."""

    def __init__(self, config: PrefillConfig, runner: LoadedModel) -> None:
        self.config = config
        self.spec = runner.spec
        self.worker = PrefillWorker(config, runner)

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
        worker = self.worker
        handoff = worker.handoff(request, len(token_ids))  # ended in finally
        push, sender = handoff.push, handoff.sender
        arrived = time.perf_counter()
        renewing: asyncio.Future | None = None
        try:
            try:
                result = worker.client.prefill(token_ids, sampling, push.deliver, handoff.abandon, kv_home=handoff.home,
                                               decoded=request.decoded_tokens, cache_salt=request.cache_salt)
            except QueueFull as exc:
                worker.metrics.count("pdserve_rejections")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except Abandoned as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if request.lease_ms:
                renewing = asyncio.ensure_future(renew_lease(request, worker.channels, push, result,
                                                             worker.engine.stalled, self.config.server.stall_s))
            try:
                prefilled = await result
            except Abandoned:
                await self._transfer_result(push, request.decode_address, context)  # raises decode's refusal
                raise
            except Exception as exc:  # its pass, or sampling its first token, failed: logged by the engine
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(exc).__name__}: {exc}")
            started, ended = prefilled.started, prefilled.ended
            record_prefill(worker.metrics, arrived, prefilled, len(token_ids), worker.prefix_cache)
            yield prefill_pb2.PrefillEvent(first_token=prefill_pb2.FirstToken(
                token_id=prefilled.first_token, queue_ms=(started - arrived) * 1e3,
                forward_ms=(ended - started) * 1e3, cached_tokens=prefilled.cached_tokens))
            push.deliver(prefilled.first_token)
            await self._transfer_result(push, request.decode_address, context)
            done = time.perf_counter()
            worker.metrics.observe("pdserve_kv_transfer_seconds", done - push.started_at, path=sender.transport)
            log.info("prefilled %d tokens (%d cached): queue %.1f ms, forward %.1f ms; KV %d bytes by %s, %.1f ms "
                     "exposed", len(token_ids), prefilled.cached_tokens, (started - arrived) * 1e3,
                     (ended - started) * 1e3, sender.bytes_sent, sender.transport, (done - ended) * 1e3)
            yield prefill_pb2.PrefillEvent(transfer_done=prefill_pb2.TransferDone(
                kv_bytes=sender.bytes_sent, chunks=sender.chunks_sent,
                exposed_ms=(done - ended) * 1e3, transfer_ms=(done - push.started_at) * 1e3,
                transport=sender.transport))
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled while grpc wrote an event
            worker.metrics.count("pdserve_cancellations")
            raise
        finally:  # finished, refused, cancelled or failed: stop computing, stop sending, end the span
            if renewing is not None:
                renewing.cancel()
            worker.end(handoff)

    async def _transfer_result(self, push: KVPush, address: str, context: grpc.aio.ServicerContext) -> None:
        """Wait for decode's acknowledgement; a refused or broken transfer ends this call with its status."""
        if push.call is None:
            await context.abort(grpc.StatusCode.CANCELLED, "the request ended before its KV was sent")
            return
        try:
            await push.call
        except grpc.aio.AioRpcError as exc:
            self.worker.metrics.count("pdserve_kv_transfer_failures", path=push.sender.transport)
            log.warning("KV transfer to %s failed, %s: %s", address, exc.code().name, exc.details())
            await context.abort(exc.code(), f"KV transfer to decode worker {address} failed: {exc.details()}")
        except asyncio.CancelledError:
            if not push.call.cancelled():  # this handler itself is being cancelled
                raise
            self.worker.metrics.count("pdserve_kv_transfer_failures", path=push.sender.transport)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer to decode worker {address} was cancelled")

    async def GetInfo(
        self, request: worker_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        engine = self.worker.engine
        return engine.report_costs(worker_pb2.WorkerInfo(
            role="prefill", model=model_info(self.spec), live_sequences=engine.live_jobs,
            queued_tokens=engine.queued_tokens, pid=os.getpid(), prefix_block_tokens=self.config.prefix_block_tokens))


async def serve(config: PrefillConfig) -> None:
    runner = await asyncio.to_thread(config.model.load, True)  # a prompt worker: its prompt GEMMs' auto choice
    await asyncio.to_thread(forward.warm_up, runner)
    servicer = PrefillServicer(config, runner)
    worker = servicer.worker
    await worker.client.calibrate()

    def register(server: grpc.aio.Server) -> list[str]:
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        return [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name]

    await serving.serve("prefill", config.server, register, worker.close, worker.metrics, stalled=worker.engine.stalled)
