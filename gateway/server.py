"""Gateway: the front door. Clients stream completions from it; it drives prefill and decode for them.

Life of a request here:
1. Generate arrives: fields are checked (INVALID_ARGUMENT names the field), the prompt is tokenized, a request
   id assigned.
2. A decode worker with room reserves a slot and KV budget (RESOURCE_EXHAUSTED when none has room).
3. A prefill worker runs the prompt and pushes its KV to that decode worker; the first token comes back at once.
   A worker that fails before then (dead, unreachable, queue full, damaged KV) is retried on another one, with
   backoff and jitter, within the deadline (journey.run_with_failover).
4. Tokens stream from decode; each batch is detokenized incrementally and checked against stop strings. If the
   decode worker dies mid-stream, the stream migrates: the tokens sent join the prompt, another decode worker
   reserves, a prefill worker re-prefills, and the stream continues with no token repeated or missing.
5. The last message carries finish_reason, usage and timing. A client cancel, disconnect or deadline cancels
   both worker calls, and each worker frees what it held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway import journey
from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.journey import GatewayError, RetryPolicy, Timings
from gateway.request import GenerateParams, InvalidRequest, parse_request
from gateway.workers import Pool, check_pairing
from model_runner.loading import DEFAULT_MODEL, resolve_model
from pdserve import serving
from pdserve.metrics import Metrics
from pdserve.serving import ServerConfig, add_server_args, server_config
from protos import gateway_pb2, gateway_pb2_grpc, worker_pb2


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    model: str = DEFAULT_MODEL  # for the tokenizer; must be the model the workers serve
    startup_timeout_s: float = 300.0
    colocate_below: int = 0  # prompts shorter than this are prefilled by the decode worker itself
    retry: RetryPolicy = RetryPolicy()

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("at least one --decode worker address is required")
        if self.colocate_below < 0:
            raise ValueError(f"--colocate-below {self.colocate_below}: must be >= 0")
        if self.retry.max_retries < 0 or self.retry.max_migrations < 0 or self.retry.backoff_s < 0:
            raise ValueError("--max-retries, --max-migrations and --retry-backoff must be >= 0")
        for address in self.prefill + self.decode:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address {address!r}: expected host:port")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return cls(server=server_config(args), prefill=_split(args.prefill), decode=_split(args.decode),
                   model=args.model, startup_timeout_s=args.startup_timeout_s, colocate_below=args.colocate_below,
                   retry=RetryPolicy(max_retries=args.max_retries, max_migrations=args.max_migrations,
                                     backoff_s=args.retry_backoff_s))

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        add_server_args(parser)
        group = parser.add_argument_group("gateway")
        group.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                           help="prefill worker address (repeat, or comma-separate); none: every request is "
                           "colocated (decode workers prefill it themselves)")
        group.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                           help="decode worker address (repeat, or comma-separate)")
        group.add_argument("--model", default=DEFAULT_MODEL, help="model directory whose tokenizer to use")
        group.add_argument("--colocate-below", type=int, default=0, metavar="TOKENS",
                           help="prompts shorter than this go to a decode worker that prefills them itself "
                           "(conditional disaggregation; default: %(default)s, never)")
        group.add_argument("--max-retries", type=int, default=RetryPolicy.max_retries,
                           help="new attempts on other workers when one fails before the first token "
                           "(default: %(default)s)")
        group.add_argument("--max-migrations", type=int, default=RetryPolicy.max_migrations,
                           help="moves of a stream to another decode worker when its worker fails mid-stream "
                           "(default: %(default)s)")
        group.add_argument("--retry-backoff", type=float, default=RetryPolicy.backoff_s, dest="retry_backoff_s",
                           help="first wait before a retry, seconds; doubles each time, with jitter "
                           "(default: %(default)s)")
        group.add_argument("--startup-timeout", type=float, default=300.0, dest="startup_timeout_s",
                           help="seconds to wait for every worker to answer (default: %(default)s)")


def _split(values: list[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, tokenizer: object, model: worker_pb2.ModelInfo, prefill: Pool, decode: Pool,
                 colocate_below: int, retry: RetryPolicy) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.prefill = prefill
        self.decode = decode
        self.colocate_below = colocate_below
        self.retry = retry
        self._in_flight: set[str] = set()
        self.metrics = Metrics(
            gauges={"pdserve_live_requests": ("requests in flight at the gateway", lambda: len(self._in_flight))},
            counters={"pdserve_requests": "requests accepted (valid and not a duplicate id)",
                      "pdserve_cancellations": "requests the client cancelled, left or let expire",
                      "pdserve_retries": "attempts retried on another worker before the first token",
                      "pdserve_migrations": "streams moved to another decode worker mid-stream",
                      "pdserve_rejections": "requests refused for capacity (RESOURCE_EXHAUSTED)"})

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        arrived = time.perf_counter()
        try:
            params = parse_request(request, self.tokenizer, self.model.vocab_size, self.model.max_model_len)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if params.request_id in self._in_flight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {params.request_id!r} is in flight")
        self._in_flight.add(params.request_id)
        self.metrics.count("pdserve_requests")
        timings = Timings()
        try:
            remaining = context.time_remaining()
            deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
            # aclosing: if a cancel lands mid-write, the journey's worker calls are cancelled now, not at GC
            async with contextlib.aclosing(self._generate(params, arrived, deadline, timings)) as responses:
                async for response in responses:
                    yield response
        except GatewayError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.metrics.count("pdserve_rejections")
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            self.metrics.count("pdserve_cancellations")
            raise
        finally:
            self._in_flight.discard(params.request_id)
            self.metrics.count("pdserve_retries", timings.retries)
            self.metrics.count("pdserve_migrations", timings.migrations)

    async def _generate(
        self, params: GenerateParams, arrived: float, deadline: float | None, timings: Timings
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.prompt_ids)
        stops = StopMatcher(params.stop)
        generated = 0
        first_at = 0.0
        finish = ""
        # aclosing: a stop string ends the loop early, and the journey must cancel its worker calls right then
        colocated = not self.prefill.workers or len(params.prompt_ids) < self.colocate_below
        journey_ = journey.run_with_failover(params, self.prefill, self.decode, timings, deadline, colocated,
                                             self.retry)
        async with contextlib.aclosing(journey_) as pieces:
            async for tokens in pieces:
                generated += len(tokens.token_ids)
                text, stopped = stops.feed(detokenizer.add(tokens.token_ids))
                finish = "stop" if stopped else tokens.finish_reason
                response = gateway_pb2.GenerateResponse(request_id=params.request_id, token_ids=tokens.token_ids,
                                                        text=text + (stops.flush() if finish else ""))
                first_at = first_at or time.perf_counter()
                if finish:
                    response.finish_reason = finish
                    response.usage.CopyFrom(gateway_pb2.Usage(prompt_tokens=len(params.prompt_ids),
                                                              completion_tokens=generated))
                    response.timing.CopyFrom(_timing(timings, arrived, first_at, generated))
                yield response
                if finish:
                    return
        raise GatewayError(grpc.StatusCode.INTERNAL, "workers ended the stream without a finish reason")


def _timing(timings: Timings, arrived: float, first_at: float, generated: int) -> gateway_pb2.Timing:
    now = time.perf_counter()
    decode_s = now - first_at
    return gateway_pb2.Timing(
        ttft_ms=(first_at - arrived) * 1e3, reserve_ms=timings.reserve_ms, prefill_queue_ms=timings.prefill_queue_ms,
        prefill_ms=timings.prefill_ms, kv_exposed_ms=timings.kv_exposed_ms, kv_transfer_ms=timings.kv_transfer_ms,
        kv_bytes=timings.kv_bytes, kv_transport=timings.kv_transport, retries=timings.retries,
        migrations=timings.migrations,
        decode_tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s else 0,
        total_ms=(now - arrived) * 1e3)


async def serve(config: GatewayConfig) -> None:
    from transformers import AutoTokenizer

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, resolve_model(config.model))
    prefill, decode = Pool("prefill", config.prefill), Pool("decode", config.decode)
    await asyncio.gather(prefill.fetch_info(config.startup_timeout_s), decode.fetch_info(config.startup_timeout_s))
    model = check_pairing(prefill, decode)
    servicer = GatewayServicer(tokenizer, model, prefill, decode, config.colocate_below, config.retry)

    def register(server: grpc.aio.Server) -> list[str]:
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    async def shutdown() -> None:
        await prefill.close()
        await decode.close()

    await serving.serve("gateway", config.server, register, shutdown, servicer.metrics)
