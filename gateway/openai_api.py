"""OpenAI-compatible HTTP on the gateway, in the same asyncio process as its gRPC server.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the gateway builds the prompt
with the tokenizer's chat template, as for a gRPC request with `messages`), streaming as server-sent events
(`data: {...}` frames, then `data: [DONE]`) or not. Each request becomes a GenerateRequest and runs through
`GatewayServicer.stream`, exactly as a gRPC request does: the same validation, admission, retries, tracing and
metrics. Failures are OpenAI error objects with the HTTP status a client expects: 400 for a bad parameter
(named in `param`), 401 for a bad API key, 404 for an unknown model, 429 with `Retry-After` when refused for
load, 503 when no worker can serve. A client that disconnects cancels its request on every service, as leaving
a gRPC stream does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from aiohttp import web

from gateway.request import InvalidRequest, RequestFailed, check_stop
from protos import gateway_pb2

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
               499: "cancelled", 503: "service_unavailable", 504: "timeout"}

# Parameters pdserve does not implement: refused when set to anything but their no-op value, never ignored.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0), "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False), "best_of": lambda v: v in (None, 1), "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0), "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v, "tools": lambda v: not v, "tool_choice": lambda v: v in (None, "none"),
    "response_format": lambda v: v in (None, {"type": "text"}),
}


class BadParameter(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI error object."""
    return web.json_response(_error_body(status, message, param, code), status=status, headers=headers)


def _failure(exc: RequestFailed) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error object of a request that failed with a gRPC status."""
    status = _HTTP_STATUS.get(exc.code, 500)
    return status, _error_body(status, exc.message, code=exc.code.name.lower())


def _failed(exc: RequestFailed) -> web.Response:
    status, body = _failure(exc)
    headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_ms / 1000)))} if status == 429 else None
    return web.json_response(body, status=status, headers=headers)


class OpenAIServer:
    def __init__(self, servicer: Any, model_name: str) -> None:
        """`servicer`: the GatewayServicer whose `stream`, `tokenizer`, `keys` and `model` it uses."""
        self.servicer, self.model_name = servicer, model_name
        self.created = int(time.time())
        app = web.Application(middlewares=[self._errors_and_keys], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)  # a disconnect cancels

    async def start(self, host: str, port: int) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        return f"{host}:{bound}"

    async def stop(self) -> None:
        await self._runner.cleanup()

    @web.middleware
    async def _errors_and_keys(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/") and not self.servicer.keys.allows(request.headers):
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
            "max_model_len": self.servicer.model.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except ValueError:
            return error(400, "the request body is not valid JSON")
        try:
            generate, stream, include_usage = self._parse(body, chat)
        except BadParameter as exc:
            status, code = (404, "model_not_found") if exc.param == "model" else (400, "invalid_parameter")
            return error(status, exc.message, param=exc.param, code=code)
        generate.request_id = request.headers.get("X-Request-Id", "")
        headers = {key.lower(): value for key, value in request.headers.items()}  # traceparent, if sent
        responses = self.servicer.stream(generate, None, headers)
        async with contextlib.aclosing(responses):
            try:  # the first response decides the status: a refusal is an HTTP error, not a stream
                first = await anext(responses)
            except RequestFailed as exc:
                return _failed(exc)
            reply = _Reply(chat, self.model_name, first.request_id)
            if not stream:
                return await self._whole(reply, first, responses)
            return await self._stream(request, reply, first, responses, include_usage)

    async def _whole(self, reply: _Reply, first: gateway_pb2.GenerateResponse,
                     responses: AsyncIterator[gateway_pb2.GenerateResponse]) -> web.Response:
        text, last = [first.text], first
        try:
            async for response in responses:
                text.append(response.text)
                last = response
        except RequestFailed as exc:
            return _failed(exc)
        return web.json_response(reply.whole("".join(text), last))

    async def _stream(self, request: web.Request, reply: _Reply, first: gateway_pb2.GenerateResponse,
                      responses: AsyncIterator[gateway_pb2.GenerateResponse], include_usage: bool,
                      ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          "X-Request-Id": first.request_id})
        await out.prepare(request)

        async def send(payload: object) -> None:
            await out.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

        if reply.chat:
            await send(reply.chunk({"role": "assistant", "content": ""}, None, include_usage))
        response: gateway_pb2.GenerateResponse | None = first
        try:
            while response is not None:
                if response.text or response.finish_reason:
                    await send(reply.chunk(response.text, response.finish_reason or None, include_usage))
                if response.finish_reason:
                    if include_usage:
                        await send(reply.usage_chunk(response.usage))
                    break
                response = await anext(responses, None)
        except RequestFailed as exc:  # mid-stream: the status is sent already, so the error is an event
            await send(_failure(exc)[1])
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def _parse(self, body: Any, chat: bool) -> tuple[gateway_pb2.GenerateRequest, bool, bool]:
        if not isinstance(body, dict):
            raise BadParameter("body", "the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, self.model_name):
            raise BadParameter("model", f"The model `{model}` does not exist; this server serves "
                               f"`{self.model_name}` (GET /v1/models)")
        for name, harmless in _UNSUPPORTED.items():
            if not harmless(body.get(name)):
                raise BadParameter(name, f"{name} is not supported by pdserve")
        n = body.get("n")
        if n not in (None, 1):
            raise BadParameter("n", "only n=1 is supported")
        generate = gateway_pb2.GenerateRequest()
        if chat:
            generate.messages.extend(self._chat_messages(body.get("messages")))
        else:
            self._completion_prompt(body.get("prompt"), generate)
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        for name, value, kind in (("max_tokens", max_tokens, int), ("temperature", body.get("temperature"), float),
                                  ("top_p", body.get("top_p"), float), ("seed", body.get("seed"), int),
                                  ("top_k", body.get("top_k"), int)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise BadParameter(name, f"{name} must be {'a number' if kind is float else 'an integer'}")
            if kind is int and value < (-1 if name == "top_k" else 0):
                raise BadParameter(name, f"{name} must be >= {-1 if name == 'top_k' else 0}")
            if name == "max_tokens" and value < 1:
                raise BadParameter(name, "max_tokens must be >= 1")
            try:
                if name == "top_k":
                    generate.top_k = max(0, int(value))  # -1 (vLLM's "off") is 0 here
                else:
                    setattr(generate, name, value)
            except (ValueError, TypeError, OverflowError):  # beyond the field's integer width
                raise BadParameter(name, f"{name} = {value} is out of range") from None
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise BadParameter("stop", "stop must be a non-empty string or a list of them")
        try:
            check_stop(stop or [])
        except InvalidRequest as exc:
            raise BadParameter("stop", str(exc)) from None
        generate.stop.extend(stop or [])
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadParameter("ignore_eos", "ignore_eos must be a boolean")
        generate.ignore_eos = ignore_eos
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadParameter("stream", "stream must be a boolean")
        options = body.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict)):
            raise BadParameter("stream_options", "stream_options is an object, allowed only with stream: true")
        include_usage = bool((options or {}).get("include_usage", False))
        return generate, stream, include_usage

    def _completion_prompt(self, prompt: Any, generate: gateway_pb2.GenerateRequest) -> None:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            generate.prompt = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 1 << 32 for t in prompt):
            generate.token_ids.extend(prompt)
        else:
            raise BadParameter("prompt", "prompt must be a non-empty string or list of token ids (one prompt: "
                               "batches of several are not supported)")

    @staticmethod
    def _chat_messages(messages: Any) -> list[gateway_pb2.ChatMessage]:
        """OpenAI messages as the gateway's; roles and the chat template are checked where gRPC's are."""
        if not isinstance(messages, list) or not messages:
            raise BadParameter("messages", "messages must be a non-empty list")
        turns = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadParameter(f"messages[{i}]", "each message is an object with a role and content")
            content = message.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadParameter(f"messages[{i}].content", "only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise BadParameter(f"messages[{i}].content", "content must be a string or a list of text parts")
            turns.append(gateway_pb2.ChatMessage(role=message["role"], content=content))
        return turns


class _Reply:
    """The OpenAI objects for one request: a whole completion, or stream chunks."""

    def __init__(self, chat: bool, model: str, request_id: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def _usage(usage: gateway_pb2.Usage) -> dict[str, Any]:
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}

    def whole(self, text: str, last: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        reply = self._object("chat.completion" if self.chat else "text_completion", [choice])
        reply["usage"] = self._usage(last.usage)
        return reply

    def chunk(self, delta: str | dict[str, str], finish_reason: str | None, include_usage: bool) -> dict[str, Any]:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: gateway_pb2.Usage) -> dict[str, Any]:
        chunk = self._object("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = self._usage(usage)
        return chunk
