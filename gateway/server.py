"""The gateway process: its gRPC edge (Generate and Cancel over the core, core.py), its HTTP edge (openai_api.py),
the worker pools and their polls. Each edge only translates; what happens to a request is the core's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import grpc

from gateway.auth import ApiKeys
from gateway.config import GatewayConfig
from gateway.core import CANCEL_CALL, Gateway
from gateway.errors import GatewayError
from gateway.messages import GenerateInput
from gateway.openai_api import (
    OpenAIServer,
)
from gateway.placement import Placement
from gateway.request import (
    Undecodable,
    lenient,
    max_prompt_chars,
)
from gateway.stalls import DEFAULT_CLIENT_STALL_TIMEOUT_S, ClientStalled, grpc_write, settled
from gateway.tokenizer import Tokenizer, model_name, tokenizer_dir
from gateway.workers import Colocation, Pool, check_pairing
from protos import gateway_pb2, gateway_pb2_grpc
from serving import server as serving

log = logging.getLogger(__name__)


class _CancelCall(Exception):
    """A Cancel call that waited for the handler's write to finish (Gateway.Generate)."""


def _peer_host(peer: str) -> str:
    """A gRPC peer ("ipv4:10.0.0.7:53124", "ipv6:[::1]:53124", "unix:/path") less its port: one client host."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rpartition(":")[0] or address
    return peer


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The gRPC edge: Generate and Cancel over the gateway's core."""

    def __init__(self, gateway: Gateway, client_stall_timeout_s: float = DEFAULT_CLIENT_STALL_TIMEOUT_S) -> None:
        self.gateway = gateway
        self.client_stall_timeout_s = client_stall_timeout_s
        # Generate handlers inside context.write -> whether a Cancel is waiting for that write to finish
        self._writing: dict[asyncio.Task, bool] = {}

    async def Generate(self, request: gateway_pb2.GenerateRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> None:
        # Writes with context.write rather than as an async generator, so that a Cancel call never interrupts a
        # write: cancelled mid-write, the write's operation stays pending in gRPC core, which then refuses the
        # status (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS) and the client waits forever. A Cancel that finds the
        # handler writing is deferred until the write is done (self._writing); anywhere else it cancels the task
        # at once and _handle turns that into a CANCELLED status.
        metadata = context.invocation_metadata()
        if not self.gateway.keys.allows(metadata):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.gateway.keys.refusal)
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        task = asyncio.current_task()
        assert task is not None
        peer = _peer_host(context.peer())
        stalled: list[asyncio.Future[None]] = []  # the write a stall left pending: any status must wait for it
        try:
            asked = request if isinstance(request, Undecodable) else GenerateInput.from_pb(request)
            responses = self.gateway.stream(asked, deadline, metadata, peer=peer)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    self._writing[task] = False
                    try:
                        await grpc_write(context, response.to_pb(), self.client_stall_timeout_s, stalled)
                    finally:
                        cancel_deferred = self._writing.pop(task)
                    if cancel_deferred:
                        raise _CancelCall
        except GatewayError as exc:
            if not await settled(stalled):
                return
            hint = (("retry-after-ms", str(exc.retry_after_ms)),) if exc.retry_after_ms else ()
            await context.abort(exc.code, exc.message, trailing_metadata=hint)
        except ClientStalled as exc:  # the stream above is closed: its place and worker calls are freed already
            self.gateway.metrics.count("pdserve_client_stalls")
            log.warning("%s (%s)", exc, context.peer())
            # The stalled write is left pending (cancelled, gRPC core would refuse any status after it), so the
            # status follows once the client reads again; if it never does, the call stays open until its
            # connection ends (keepalive closes a peer that answers no ping), holding one response and one of
            # grpc's --max-concurrent-rpcs. Until then it counts against its client's --max-in-flight-per-client,
            # so that one client cannot pile up such calls past its share.
            with self.gateway.admission.holding(self.gateway.keys.tenant(metadata) or peer):
                if not await settled(stalled):
                    return
            await context.abort(grpc.StatusCode.CANCELLED, str(exc))
        except _CancelCall:  # the stream above is closed (and counted): its worker calls are cancelled
            log.info("ended with CANCELLED: %s, once its write was done", CANCEL_CALL)
            if not await settled(stalled):
                return
            await context.abort(grpc.StatusCode.CANCELLED, CANCEL_CALL)
        except asyncio.CancelledError:
            # Only the client's own cancel, disconnect or deadline (grpc.aio cancels this task for them) may leave
            # the handler with CancelledError: that client is gone. Any other cancel still owes it a status.
            if task.cancelling():
                raise
            # not this task's cancel: a worker call cancelled under it that the journey did not catch
            if not await settled(stalled):
                return
            await context.abort(grpc.StatusCode.UNAVAILABLE, "a worker call was cancelled under the request")

    async def Cancel(
        self, request: gateway_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CancelResponse:
        keys = self.gateway.keys
        if not keys.allows(context.invocation_metadata()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, keys.refusal)
        if isinstance(request, Undecodable):  # see register(); Generate's are refused by parse_request
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        cancelled = self.gateway.cancel(keys.tenant(context.invocation_metadata()), request.request_id, self._defer)
        return gateway_pb2.CancelResponse(cancelled=cancelled)

    def _defer(self, task: asyncio.Task) -> bool:
        """Never mid-write (see Generate): a handler inside a write ends the request once the write is done."""
        if task in self._writing:
            self._writing[task] = True
            return True
        return False


async def serve(config: GatewayConfig) -> None:
    # Chat templates render in Python on the tokenizing threads (request.py): such a thread hands the GIL back to
    # the event loop within 1 ms instead of the default 5, and streams keep their pace beside a long conversation.
    sys.setswitchinterval(0.001)
    prefill = Pool("prefill", config.prefill, tls=config.server.tls, prefix_balance_tokens=config.prefix_balance_tokens,
                   keepalive=config.keepalive)
    decode = Pool("decode", config.decode, tls=config.server.tls, keepalive=config.keepalive)
    await asyncio.gather(prefill.fetch_info(config.startup_timeout_s), decode.fetch_info(config.startup_timeout_s))
    model = check_pairing(prefill, decode)
    tokenizer = await asyncio.to_thread(Tokenizer.from_dir, tokenizer_dir(config.model))
    max_prompt_chars(tokenizer, model.max_model_len)  # its vocabulary scan holds the GIL ~20 ms: now, not in a request
    gateway = Gateway(tokenizer, model, prefill, decode,
                      Placement(config.placement, Colocation(config.colocate_below, config.colocate_queued),
                                config.target_ttft_ms, config.target_tpot_ms, config.split_above), config.retry,
                      config.admission, ApiKeys.load(config.api_key_file))
    servicer = GatewayServicer(gateway, config.client_stall_timeout_s)
    http = OpenAIServer(gateway, config.served_model_name or model_name(config.model), config.http_body_timeout_s,
                        config.http_deadline_s, config.client_stall_timeout_s, config.max_http_connections,
                        config.sse_min_write_bytes)
    announce = {}
    if config.http_port >= 0:
        announce["http"] = await http.start(config.server.host, config.http_port)

    def register(server: grpc.aio.Server) -> list[str]:
        # gateway_pb2_grpc's handlers but for the deserializers: bytes that are no valid message (bad UTF-8 in a
        # string) reach the handlers, which answer INVALID_ARGUMENT, where grpc would answer UNKNOWN
        name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate, request_deserializer=lenient(gateway_pb2.GenerateRequest),
                response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
            "Cancel": grpc.unary_unary_rpc_method_handler(
                servicer.Cancel, request_deserializer=lenient(gateway_pb2.CancelRequest),
                response_serializer=gateway_pb2.CancelResponse.SerializeToString)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
        return [name]

    polls = [asyncio.ensure_future(pool.poll(config.poll_interval_s)) for pool in (prefill, decode) if pool.workers]

    async def shutdown() -> None:
        await http.stop()
        for poll in polls:
            poll.cancel()
        await prefill.close()
        await decode.close()

    await serving.serve("gateway", config.server, register, shutdown, gateway.metrics, announce)
