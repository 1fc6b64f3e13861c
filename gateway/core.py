"""The gateway's core: one request from its arrival to its last token, whatever the transport (gRPC or HTTP).

Life of a request here:
1. A request arrives as a GenerateInput (messages.py: each edge translates its own wire format into it). Admission
   first, before any work: at most --max-in-flight requests run and --max-queue wait, each client within its own
   share (admission.py); beyond that, or after --queue-timeout, RESOURCE_EXHAUSTED with a retry-after-ms hint.
2. Its fields are checked (INVALID_ARGUMENT names the field), the prompt tokenized, a request id assigned, and
   its prompt placed (placement.py). A decode worker with room reserves a slot and KV budget; while none has
   room the request waits, within the same timeout.
3. A prefill worker runs the prompt and pushes its KV to that decode worker; the first token comes back at once.
   A worker that fails before then (dead, unreachable, queue full, damaged KV) is retried on another one, with
   backoff and jitter, within the deadline (failover.run_with_failover).
4. Tokens stream from decode; each batch is detokenized incrementally and checked against stop strings. If the
   decode worker dies mid-stream, the stream migrates: the tokens sent join the prompt, another decode worker
   reserves, a prefill worker re-prefills, and the stream continues with no token repeated or missing.
5. The last message carries finish_reason, usage and timing. A client cancel, disconnect or deadline cancels
   both worker calls, and each worker frees what it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from gateway.admission import Admission, AdmissionConfig, Overloaded
from gateway.auth import ApiKeys
from gateway.breakers import PairBreakers
from gateway.detokenizer import TextStream
from gateway.errors import GatewayError, InvalidRequest
from gateway.failover import RetryPolicy, run_with_failover
from gateway.journey import Timings
from gateway.messages import Delta, GenerateInput, Timing, Usage
from gateway.placement import Placement
from gateway.request import MAX_REQUEST_ID_CHARS, GenerateParams, Undecodable, parse_request
from gateway.workers import Pool
from protos import worker_pb2
from serving import logs, tracing
from serving.metrics import Metrics

log = logging.getLogger(__name__)

CANCEL_CALL = "request was cancelled by a Cancel call"  # the message a Cancel call cancels a handler's task with


def _given_id(request: GenerateInput | Undecodable) -> str:
    """The request id a client chose, if it is one parse_request accepts (it refuses the rest)."""
    if isinstance(request, Undecodable):
        return ""
    rid = request.request_id
    return rid if len(rid) <= MAX_REQUEST_ID_CHARS and rid.isprintable() else ""


class Gateway:
    """What the gateway does for one request, whatever the transport: admission, tokenizing, placement, the
    journey across workers with retries and migration, detokenizing and stop strings; traced, counted and logged
    the same way for every edge. The gRPC edge (server.py) and the HTTP edge (openai_api.py) only translate."""

    def __init__(self, tokenizer: Any, model: worker_pb2.ModelInfo, prefill: Pool, decode: Pool,
                 colocation: Placement, retry: RetryPolicy, admission: AdmissionConfig,
                 keys: ApiKeys | None = None) -> None:
        self.tokenizer = tokenizer
        self.keys = keys or ApiKeys()
        self.model = model
        self.eos_token_ids = frozenset(model.eos_token_ids)
        self.prefill = prefill
        self.decode = decode
        self.colocation = colocation
        self.retry = retry
        self.admission = Admission(admission)
        self.pairs = PairBreakers()
        # Request ids are scoped to their tenant (auth.ApiKeys.tenant): keys are (tenant, request id).
        self._in_flight: set[tuple[str, str]] = set()
        self._live = 0  # requests in _handle: queued, tokenizing or running
        self._tasks: dict[tuple[str, str], asyncio.Task | None] = {}  # -> its Generate handler, for Cancel
        self._cancelled: set[tuple[str, str]] = set()  # ids that Cancel ended
        self._refusals = logs.SampledLog(log, "RESOURCE_EXHAUSTED")
        self.metrics = Metrics(
            gauges={"pdserve_live_requests": ("requests in flight at the gateway, queued ones included",
                                              lambda: self._live),
                    "pdserve_queued_requests": ("requests waiting for a place", lambda: self.admission.queued),
                    "pdserve_serving_prefill_workers": ("prefill workers routed to: SERVING at their last health poll",
                                                        lambda: sum(w.serving for w in self.prefill.workers)),
                    "pdserve_serving_decode_workers": ("decode workers routed to: SERVING at their last health poll",
                                                       lambda: sum(w.serving for w in self.decode.workers)),
                    "pdserve_prefix_index_bytes": ("memory of the prefix index kept to route prompts by prefix "
                                                   "(bounded: 200,000 block names per prefill worker)",
                                                   lambda: self.prefill.prefixes.nbytes)},
            counters={"pdserve_requests": "requests accepted (valid and not a duplicate id)",
                      "pdserve_cancellations": "requests the client cancelled, left or let expire",
                      "pdserve_retries": "attempts retried on another worker before the first token",
                      "pdserve_migrations": "streams moved to another decode worker mid-stream",
                      "pdserve_rejections": "requests refused for capacity (RESOURCE_EXHAUSTED)",
                      "pdserve_paused_refusals": "refusals answered after a pause, their client refused more than "
                      "--instant-refusals-per-client times in a second",
                      "pdserve_client_stalls": "requests cut because their client read nothing for "
                                               "--client-stall-timeout",
                      "pdserve_prompt_tokens": "prompt tokens of finished requests",
                      "pdserve_generation_tokens": "tokens streamed to clients",
                      "pdserve_placements": "finished requests by where their prompt ran (prefill or colocated)"},
            histograms={"pdserve_time_to_first_token_seconds": "request arrival to its first token",
                        "pdserve_inter_token_latency_seconds": "gap between two tokens of a stream",
                        "pdserve_e2e_request_latency_seconds": "request arrival to its last token",
                        "pdserve_queue_time_seconds": "time waiting for a place at the gateway",
                        "pdserve_placement_ttft_error_ratio": "a placed attempt's TTFT over the TTFT predicted for it "
                                                              "(1: exact)"})

    async def stream(
        self, request: GenerateInput | Undecodable, deadline: float | None,
        metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None = None, peer: str = "",
    ) -> AsyncGenerator[Delta, None]:
        """One request's answer, piece by piece, whatever the edge (gRPC in server.py, HTTP in openai_api.py):
        traced, counted and logged the same way. Ends with GatewayError when the request is refused or fails;
        cancelling the caller's task cancels it on every worker. `deadline` is on the event loop's clock;
        `metadata` may carry the client's `traceparent`. `peer`: the client's address, its identity for admission
        when the gateway has no API keys."""
        # a client's traceparent is honoured: this span joins its trace
        with tracing.tracer.start_as_current_span(
            "gateway", context=tracing.incoming(metadata), kind=SpanKind.SERVER,
        ) as span:
            generated = 0
            arrived = last = time.perf_counter()
            finished = cancelled = False
            try:
                # aclosing: closed early (a stop string, a deferred Cancel), the journey's calls end now, not at GC
                tenant = self.keys.tenant(metadata)
                handle = self._handle(request, deadline, arrived, tenant, tenant or peer)
                async with contextlib.aclosing(handle) as responses:
                    async for response in responses:
                        now = time.perf_counter()
                        tokens = len(response.token_ids)
                        if not generated:
                            span.add_event("first token")
                            self.metrics.observe("pdserve_time_to_first_token_seconds", now - arrived)
                            if tokens > 1:  # tokens that came with the first one: no gap after it
                                self.metrics.observe("pdserve_inter_token_latency_seconds", 0.0, tokens - 1)
                        elif tokens:  # tokens that arrive together share the gap
                            self.metrics.observe("pdserve_inter_token_latency_seconds", (now - last) / tokens, tokens)
                        last = now
                        generated += tokens
                        self.metrics.count("pdserve_generation_tokens", tokens)
                        if response.finish_reason:
                            finished = True
                            self._finished(response, now - arrived, generated)
                        yield response
            except asyncio.CancelledError:
                cancelled = True
                _record_cancel(span, generated)
                raise
            except GeneratorExit:  # closed before its end: the client left mid-write, or a Cancel waited for one
                cancelled = not finished
                if cancelled:  # the same trace event and log line as a cancel between two writes
                    _record_cancel(span, generated)
                raise
            except GatewayError as exc:
                cancelled = exc.code == grpc.StatusCode.CANCELLED  # by a Cancel call
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{exc.code.name}: {exc.message}"))
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._refusals.log(exc.message)
                else:
                    log.info("ended with %s: %s", exc.code.name, exc.message)
                raise
            finally:
                span.set_attribute("pdserve.output_tokens", generated)
                if cancelled:  # counted here, once, whichever way the transport saw it end
                    self.metrics.count("pdserve_cancellations")

    def _finished(self, response: Delta, seconds: float, generated: int) -> None:
        usage, timing = response.usage, response.timing
        assert usage is not None and timing is not None  # the last piece carries both
        self.metrics.observe("pdserve_e2e_request_latency_seconds", seconds)
        self.metrics.count("pdserve_prompt_tokens", usage.prompt_tokens)
        span = trace.get_current_span()
        span.add_event("finish", {"pdserve.finish_reason": response.finish_reason})
        span.set_attributes({"pdserve.prompt_tokens": usage.prompt_tokens, "pdserve.retries": timing.retries,
                             "pdserve.migrations": timing.migrations, "pdserve.kv_transport": timing.kv_transport,
                             "pdserve.kv_bytes": timing.kv_bytes})
        self.metrics.count("pdserve_placements", placement=timing.placement)
        if timing.predicted_ttft_ms and timing.placed_ttft_ms:
            self.metrics.observe("pdserve_placement_ttft_error_ratio", timing.placed_ttft_ms / timing.predicted_ttft_ms,
                                 placement=timing.placement)
        log.info("finished (%s): %d prompt + %d tokens, TTFT %.0f ms, total %.0f ms, %d retries, %d migrations; "
                 "placed: %s", response.finish_reason, usage.prompt_tokens, generated, timing.ttft_ms,
                 timing.total_ms, timing.retries, timing.migrations, timing.placement_reason)

    async def _handle(
        self, request: GenerateInput | Undecodable, deadline: float | None, arrived: float, tenant: str, client: str
    ) -> AsyncGenerator[Delta, None]:
        # Admitted before any work: a request waits for its client's share of the places (admission.py) before it
        # is tokenized, so a flood of prompts costs the tokenizer no more than the places it was given.
        owned = self._claim(tenant, _given_id(request))  # a queued request with its own id can be cancelled
        self._live += 1
        timings = Timings()
        try:
            queued = time.perf_counter()
            async with self.admission.slot(deadline, client):
                admitted = time.perf_counter()
                self.metrics.observe("pdserve_queue_time_seconds", admitted - queued)
                tracing.record("gateway.queue", None, queued, admitted, {"pdserve.in_flight": self.admission.running})
                try:
                    params = await parse_request(request, self.tokenizer, self.model.vocab_size,
                                                 self.model.max_model_len, tenant=tenant, deadline=deadline)
                except InvalidRequest as exc:
                    raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
                params = self.colocation.with_defaults(params)
                trace.get_current_span().set_attribute("pdserve.request_id", params.request_id)
                logs.for_request(params.request_id)
                owned = owned or self._claim(tenant, params.request_id)
                self.metrics.count("pdserve_requests")
                # aclosing: if a cancel lands mid-write, the journey's worker calls are cancelled now, not at GC
                async with contextlib.aclosing(self._generate(params, arrived, deadline, timings)) as responses:
                    async for response in responses:
                        yield response
        except Overloaded as exc:
            self.metrics.count("pdserve_rejections")
            if exc.paused:
                self.metrics.count("pdserve_paused_refusals")
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                               retry_after_ms=self.admission.retry_after_ms) from None
        except GatewayError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # no room, or predicted late: refused for load
                self.metrics.count("pdserve_rejections")
                exc.retry_after_ms = exc.retry_after_ms or self.admission.retry_after_ms
            raise
        except asyncio.CancelledError:
            if owned in self._cancelled:  # Cancel, not the client: the client gets a status
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                raise GatewayError(grpc.StatusCode.CANCELLED,
                                   f"request {owned[1]!r} was cancelled by a Cancel call") from None  # type: ignore[index]
            raise
        finally:
            self._live -= 1
            if owned is not None:
                self._in_flight.discard(owned)
                self._tasks.pop(owned, None)
                self._cancelled.discard(owned)
            self.metrics.count("pdserve_retries", timings.retries)
            self.metrics.count("pdserve_migrations", timings.migrations)

    def _claim(self, tenant: str, request_id: str) -> tuple[str, str] | None:
        """Register the calling task as `request_id`'s (for Cancel); ALREADY_EXISTS if the tenant runs that id."""
        if not request_id:
            return None
        owned = tenant, request_id
        if owned in self._in_flight:
            raise GatewayError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is in flight")
        self._in_flight.add(owned)
        self._tasks[owned] = asyncio.current_task()
        return owned

    def cancel(self, tenant: str, request_id: str, defer: Callable[[asyncio.Task], bool]) -> bool:
        """Cancel `tenant`'s request `request_id` (a Cancel call): False when it is not in flight. Its handler's
        task is cancelled at once, unless `defer(task)` says the edge will end it itself (gRPC, mid-write); then
        the request still ends as CANCELLED by a Cancel call. Another tenant's id looks like one that does not
        exist."""
        owned = tenant, request_id
        task = self._tasks.get(owned)
        if task is None or task.done() or owned in self._cancelled:
            return False
        self._cancelled.add(owned)
        if not defer(task):  # unwinds the journey exactly as a client cancel does: both worker calls are cancelled
            task.cancel(CANCEL_CALL)
        return True

    async def _generate(
        self, params: GenerateParams, arrived: float, deadline: float | None, timings: Timings
    ) -> AsyncGenerator[Delta, None]:
        text_stream = TextStream(self.tokenizer, params.prompt_ids, params.stop)
        generated = 0
        first_at = 0.0
        finish = ""
        # aclosing: a stop string ends the loop early, and the journey must cancel its worker calls right then
        journey_ = run_with_failover(params, self.prefill, self.decode, timings, deadline, self.colocation,
                                             self.retry, self.pairs, self.eos_token_ids)
        async with contextlib.aclosing(journey_) as pieces:
            async for tokens in pieces:
                generated += len(tokens.token_ids)
                text, token_ids, stopped = text_stream.add(tokens.token_ids, last=bool(tokens.finish_reason))
                finish = "stop" if stopped else tokens.finish_reason
                if not (text or token_ids or finish):
                    continue  # all held back: half a character, or what may begin a stop string
                first_at = first_at or time.perf_counter()
                if finish:
                    yield Delta(params.request_id, token_ids, text, finish,
                                Usage(len(params.prompt_ids), text_stream.consumed, timings.cached_tokens),
                                _timing(timings, arrived, first_at, generated))
                    return
                yield Delta(params.request_id, token_ids, text)
        raise GatewayError(grpc.StatusCode.INTERNAL, "workers ended the stream without a finish reason")


def _record_cancel(span: trace.Span, generated: int) -> None:
    """A request its client cancelled or left: where it was, on its span and in the log."""
    phase = "decoding" if generated else "before first token"
    span.add_event("cancelled", {"pdserve.phase": phase, "pdserve.tokens_sent": generated})
    log.info("cancelled %s, after %d tokens", phase, generated)


def _timing(timings: Timings, arrived: float, first_at: float, generated: int) -> Timing:
    now = time.perf_counter()
    decode_s = now - first_at
    return Timing(
        **timings.hops(), ttft_ms=(first_at - arrived) * 1e3,
        predicted_ttft_ms=(timings.predicted_ttft_s or 0.0) * 1e3, placed_ttft_ms=(timings.attempt_ttft_s or 0.0) * 1e3,
        decode_tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s else 0,
        total_ms=(now - arrived) * 1e3)
