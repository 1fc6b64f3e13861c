"""OpenAI-compatible HTTP on the gateway, in the same asyncio process as its gRPC server.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the gateway builds the prompt
with the tokenizer's chat template, as for a gRPC request with `messages`), streaming as server-sent events
(`data: {...}` frames, then `data: [DONE]`) or not. Each request becomes a GenerateInput (messages.py) and runs
through `Gateway.stream` (core.py), exactly as a gRPC request does: the same validation, admission, retries, tracing and
metrics. Failures are OpenAI error objects with the HTTP status a client expects: 400 for a bad parameter
(named in `param`), 401 for a bad API key, 404 for an unknown model, 429 with `Retry-After` when refused for
load, 503 when no worker can serve. A client that disconnects cancels its request on every service, as leaving
a gRPC stream does.

Hostile bodies cost bounded work: a body over MAX_BODY_BYTES is refused (413) by its Content-Length before a byte
is read, or as soon as a chunked one passes it; one that does not arrive within the body timeout is refused (408);
JSON that repeats a key, nests past Python's recursion limit, or carries NaN is refused (400). Fields this API does
not know are ignored with a warning, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from aiohttp import web

from gateway.core import Gateway
from gateway.errors import HTTP_STATUS, GatewayError, error_body
from gateway.messages import Delta, Usage
from gateway.openai_body import (
    BadBody,
    BadParameter,
    parse_json,
    read_body,
    unicode_param,
)
from gateway.stalls import DEFAULT_CLIENT_STALL_TIMEOUT_S, ClientStalled, sse_write

log = logging.getLogger(__name__)

# A request body's size: 1 MiB, aiohttp's own default. That is ~250,000 tokens of prompt, past any context served
# here (docs/architecture.md, "Why these numbers").
MAX_BODY_BYTES = 1 << 20
# Bodies over this are parsed on a thread of their own (parse_json), one at a time; smaller ones take < 2 ms on the
# event loop.
BIG_BODY_BYTES = 64 << 10
_PARSING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse-json")
# Bodies read and parsed at once: what they hold in memory is bounded (16 MiB at most) whatever the connections.
MAX_BODIES_AT_ONCE = 16
# Open HTTP connections: each holds a file descriptor and up to ~200 KB of socket buffers; 512 is 8 per running
# place (--max-in-flight 64), room for every client's keep-alive pool. Past it a new connection gets 503.
DEFAULT_MAX_CONNECTIONS = 512
SEND_BUFFER_BYTES = 64 << 10  # the kernel doubles it: ~128 KB, a few hundred SSE events
# Every SSE data event is padded to at least this many bytes with spaces after its JSON (see `padded`).
# Linux charges each small segment a whole buffer's overhead and, for a socket that never reads, grows its receive
# buffer toward net.ipv4.tcp_rmem's maximum instead of closing the window: events of ~250 bytes at a decode pace
# were taken for minutes, so a client that stopped reading was never seen to stall. Segments of 512 bytes and more
# fill its default buffer and close the window after ~120 KB (docs/reliability.md, "What a server cannot see");
# 1 KiB leaves room on other kernels, at a few kB/s more per stream.
DEFAULT_SSE_MIN_WRITE_BYTES = 1024
# Seconds the whole body may take to arrive once the headers have: a slowloris client trickling it holds a
# connection, never more, and only this long. 1 MiB arrives in 30 s at 280 kbit/s.
DEFAULT_BODY_TIMEOUT_S = 30.0
# An HTTP request's deadline: OpenAI clients send none (their timeout is their own), and a request without one could
# wait forever on a worker that hangs in a way no other timer catches. Ten minutes covers any generation this
# gateway serves (a full 8k context at 50 ms a token is under 7 minutes); Envoy's default route timeout (15 s)
# would cut long streams.
DEFAULT_HTTP_DEADLINE_S = 600.0

def error(status: int, message: str, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI error object."""
    return web.json_response(error_body(status, message, param, code), status=status, headers=headers)


def _failure(exc: GatewayError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error object of a request that failed with a gRPC status."""
    status = HTTP_STATUS.get(exc.code, 500)
    return status, error_body(status, exc.message, code=exc.code.name.lower())


def _failed(exc: GatewayError) -> web.Response:
    status, body = _failure(exc)
    headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_ms / 1000)))} if status == 429 else None
    return web.json_response(body, status=status, headers=headers)


def padded(event: bytes, least: int) -> bytes:
    """An SSE data event brought to at least `least` bytes (DEFAULT_SSE_MIN_WRITE_BYTES says why) by spaces after
    its JSON, before the line ends: JSON allows whitespace there, so every client parses the same value. The
    padding stays inside the one event. As a comment block after it (how it was first done), a client that strips
    each network read before splitting at blank lines, as `vllm bench serve` does, glued each comment to the next
    event and skipped both as a comment: it lost about half the tokens."""
    short = least - len(event)
    if short <= 0 or not event.endswith(b"\n\n"):
        return event
    return event[:-2] + b" " * short + b"\n\n"


class _Refuse(asyncio.Protocol):
    """A connection past --max-http-connections: answered 503 with Retry-After before any request of it is read,
    then closed once the client has closed its side, or after a second (a lingering close: closing with the
    client's request unread would reset the connection and could drop the answer before the client reads it)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = json.dumps(error_body(503, "too many HTTP connections to this gateway (--max-http-connections); "
                                      "retry later, or reuse a connection", code="too_many_connections")).encode()
        self.transport = cast(asyncio.WriteTransport, transport)  # uvloop's transports are no subclass of asyncio's
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._closing = asyncio.get_running_loop().call_later(1.0, self.transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # read and dropped

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing.cancel()


class OpenAIServer:
    def __init__(self, gateway: Gateway, model_name: str, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 deadline_s: float = DEFAULT_HTTP_DEADLINE_S,
                 stall_timeout_s: float = DEFAULT_CLIENT_STALL_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 sse_min_write_bytes: int = DEFAULT_SSE_MIN_WRITE_BYTES) -> None:
        """`gateway`: the core whose `stream`, `keys`, `model` and `metrics` it uses. `deadline_s`:
        every HTTP request's deadline (HTTP clients send none; without one a request could wait forever)."""
        self.gateway, self.model_name, self.body_timeout_s = gateway, model_name, body_timeout_s
        self.deadline_s = deadline_s
        self.stall_timeout_s = stall_timeout_s  # a stream the client leaves undrained this long is cut
        self.sse_min_write_bytes = sse_min_write_bytes
        self.created = int(time.time())
        app = web.Application(middlewares=[self._errors_and_keys], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)  # a disconnect cancels
        self._listener: asyncio.Server | None = None
        self.max_connections = max_connections
        self._bodies = asyncio.Semaphore(MAX_BODIES_AT_ONCE)

    async def start(self, host: str, port: int) -> str:
        await self._runner.setup()
        server = self._runner.server
        assert server is not None

        def connection() -> asyncio.BaseProtocol:  # past the cap, a new connection is answered 503 and closed
            return _Refuse() if len(server.connections) >= self.max_connections else server()

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: a fixed send buffer, not autotuned up to 4 MB, bounds what a reader that
        # stops reading parks in the kernel, so its stream stalls (and is cut) within a few hundred tokens.
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        listening.bind((host, port))
        self._listener = await asyncio.get_running_loop().create_server(connection, sock=listening, backlog=128)
        return f"{host}:{listening.getsockname()[1]}"

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        await self._runner.cleanup()

    @web.middleware
    async def _errors_and_keys(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/") and not self.gateway.keys.allows(request.headers):
            return error(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                         code="invalid_api_key")
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own refusals (unknown route, body too large), as OpenAI errors
            if exc.status < 400:
                raise
            return error(exc.status, exc.reason, headers={k: v for k, v in exc.headers.items()
                                                           if k.lower() == "allow"})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
            "max_model_len": self.gateway.model.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            generate, stream, include_usage = read_body(body, chat, self.model_name)
            generate.request_id = unicode_param(request.headers.get("X-Request-Id", ""), "X-Request-Id")
        except BadBody as exc:
            refusal = error(exc.status, exc.message, param=exc.param, code="invalid_body")
            if exc.status in (408, 413):  # the rest of the body is not read: the connection cannot carry another
                refusal.force_close()
            return refusal
        except BadParameter as exc:
            code = "model_not_found" if exc.status == 404 else "invalid_parameter"
            return error(exc.status, exc.message, param=exc.param, code=code)
        headers = {key.lower(): value for key, value in request.headers.items()}  # traceparent, if sent
        deadline = asyncio.get_running_loop().time() + self.deadline_s
        responses = self.gateway.stream(generate, deadline, headers, peer=request.remote or "")
        async with contextlib.aclosing(responses):
            try:  # the first response decides the status: a refusal is an HTTP error, not a stream
                first = await anext(responses)
            except GatewayError as exc:
                return _failed(exc)
            reply = _Reply(chat, self.model_name, first.request_id)
            if not stream:
                return await self._whole(reply, first, responses)
            return await self._stream(request, reply, first, responses, include_usage)

    async def _body(self, request: web.Request) -> Any:
        """The request's JSON body, its size and its arrival time bounded before it is parsed. At most
        MAX_BODIES_AT_ONCE are read and parsed at once (the rest wait, within the same body timeout)."""
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise BadBody(413, f"the request body is {request.content_length} bytes; at most {MAX_BODY_BYTES} are "
                          "accepted")
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async with self._bodies:
                    raw = await request.read()  # aiohttp stops a chunked body at client_max_size
                    if len(raw) <= BIG_BODY_BYTES:
                        return parse_json(raw)
                    # json.loads holds the GIL throughout, unless it calls back into Python: with Python hooks for
                    # numbers a thread hands the loop the GIL every switch interval (a 1 MiB list of token ids:
                    # ~7 ms the loop waits at most, ~30 ms parsed on the loop)
                    return await asyncio.get_running_loop().run_in_executor(_PARSING, parse_json, raw, True)
        except web.HTTPRequestEntityTooLarge:
            raise BadBody(413, f"the request body is over {MAX_BODY_BYTES} bytes, the most accepted") from None
        except TimeoutError:
            raise BadBody(408, f"the request body did not arrive within {self.body_timeout_s:g} s") from None

    async def _whole(self, reply: _Reply, first: Delta, responses: AsyncIterator[Delta]) -> web.Response:
        text, last = [first.text], first
        try:
            async for response in responses:
                text.append(response.text)
                last = response
        except GatewayError as exc:
            return _failed(exc)
        return web.json_response(reply.whole("".join(text), last))

    async def _stream(self, request: web.Request, reply: _Reply, first: Delta, responses: AsyncIterator[Delta],
                      include_usage: bool) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          "X-Request-Id": first.request_id})
        await out.prepare(request)

        stall_s = self.stall_timeout_s

        async def send(payload: object) -> None:
            event = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
            await sse_write(out, padded(event, self.sse_min_write_bytes), stall_s)

        try:
            if reply.chat:
                await send(reply.chunk({"role": "assistant", "content": ""}, None, include_usage))
            response: Delta | None = first
            try:
                while response is not None:
                    if response.text or response.token_ids or response.finish_reason:
                        await send(reply.chunk(response.text, response.finish_reason or None, include_usage,
                                               tokens=bool(response.token_ids)))
                    if response.finish_reason:
                        if include_usage and response.usage is not None:
                            await send(reply.usage_chunk(response.usage))
                        break
                    response = await anext(responses, None)
            except GatewayError as exc:  # mid-stream: the status is sent already, so the error is an event
                await send(_failure(exc)[1])
            await sse_write(out, b"data: [DONE]\n\n", stall_s)
        except ClientStalled as exc:
            # Cut: the stream's place and worker calls are freed as this returns (_serve closes the responses),
            # and the connection is closed under the client, its unread bytes dropped.
            self.gateway.metrics.count("pdserve_client_stalls")
            log.warning("%s (%s)", exc, request.remote)
            if request.transport is not None:
                request.transport.abort()
            return out
        await out.write_eof()
        return out

class _Reply:
    """The OpenAI objects for one request: a whole completion, or stream chunks."""

    def __init__(self, chat: bool, model: str, request_id: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def _usage(usage: Usage) -> dict[str, Any]:
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}

    def whole(self, text: str, last: Delta) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        reply = self._object("chat.completion" if self.chat else "text_completion", [choice])
        reply["usage"] = self._usage(last.usage or Usage(0, 0))
        return reply

    def chunk(self, delta: str | dict[str, str], finish_reason: str | None, include_usage: bool,
              tokens: bool = False) -> dict[str, Any]:
        """`tokens`: the chunk carries tokens. A chat chunk has content when it has text or tokens: a token
        without text (a special one) is a chunk with content "", as vLLM sends it."""
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta or tokens else {})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._object("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = self._usage(usage)
        return chunk
