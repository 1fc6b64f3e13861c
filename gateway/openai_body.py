"""The OpenAI-compatible API's request bodies: JSON parsed strictly (a repeated key, NaN or a lone surrogate is
refused, not resolved), the fields read into the core's GenerateInput (read_body), and the parameters refused
rather than ignored."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from gateway.errors import InvalidRequest
from gateway.messages import ChatTurn, GenerateInput, Slo
from gateway.request import MAX_MESSAGES, MAX_STOP_STRINGS, check_stop
from protos.types import check_temperature

log = logging.getLogger(__name__)

# Parameters pdserve does not implement: refused when set to anything but their no-op value, never ignored.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0), "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False), "best_of": lambda v: v in (None, 1), "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0), "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v, "tools": lambda v: not v, "tool_choice": lambda v: v in (None, "none"),
    "response_format": lambda v: v in (None, {"type": "text"}),
    "functions": lambda v: not v, "function_call": lambda v: v in (None, "none"),
}
# The fields read; any other is ignored with a warning, as vLLM does (its requests allow extra fields and log
# "fields were present in the request but ignored"), so clients that send newer OpenAI fields keep working.
FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "ignore_eos", "n", "user", "cache_salt", "slo", *UNSUPPORTED}
COMPLETION_FIELDS = FIELDS | {"prompt"}
CHAT_FIELDS = FIELDS | {"messages", "max_completion_tokens"}
# The integer parameters' widths on the wire to the workers (gateway.proto: uint32, uint64): above them, refused.
INTEGER_LIMITS = {"max_tokens": 1 << 32, "seed": 1 << 64, "top_k": 1 << 32}


def parse_slo(given: Any, slo: Slo) -> None:
    """pdserve's extension field `slo`: {"ttft_ms": int, "tpot_ms": int, "refuse_late": bool}, any of them
    (gateway.proto Slo; their bounds are checked with the rest of the request)."""
    if given is None:
        return
    if not isinstance(given, dict) or not set(given) <= {"ttft_ms", "tpot_ms", "refuse_late"}:
        raise BadParameter("slo", "slo is an object with ttft_ms, tpot_ms (milliseconds) and refuse_late")
    for name in ("ttft_ms", "tpot_ms"):
        value = given.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
            raise BadParameter("slo", f"slo.{name} must be a whole number of milliseconds >= 0")
        setattr(slo, name, value)
    refuse = given.get("refuse_late", False)
    if not isinstance(refuse, bool):
        raise BadParameter("slo", "slo.refuse_late must be a boolean")
    slo.refuse_late = refuse


class BadParameter(Exception):
    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


class BadBody(Exception):
    """A body refused before its fields are read: too large (413), too slow (408), or not JSON (400)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A repeated key is refused, not resolved: parsers disagree on which copy wins (Python's json keeps the last),
    # so a proxy in front could check one value and pdserve use the other.
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKey(key)
            seen.add(key)
    return obj


def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json takes NaN and Infinity unless told not to


def short(name: str) -> str:
    """A client's string, safe and short for a message or a log line."""
    return repr(name[:40] + ("..." if len(name) > 40 else ""))


def unicode_param(value: str, param: str) -> str:
    """`value`, if it can travel on as UTF-8: JSON's \\ud800 escapes decode to lone surrogates, which cannot."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadParameter(param, f"{param} is not valid Unicode: it holds a lone surrogate") from None
    return value


def parse_json(raw: bytes, yielding: bool = False) -> Any:
    """`raw` as JSON, or BadBody. `yielding`: numbers are parsed by Python functions, each a point where a thread
    parsing a big body lets the event loop run."""
    hooks: dict[str, Any] = {"parse_int": lambda text: int(text), "parse_float": lambda text: float(text)} \
        if yielding else {}
    try:
        return json.loads(raw, object_pairs_hook=unique_keys, parse_constant=no_constant, **hooks)
    except RepeatedKey as exc:
        raise BadBody(400, f"the request body repeats the key {short(exc.key)}", param=exc.key[:40]) from None
    except UnicodeDecodeError:
        raise BadBody(400, "the request body is not valid UTF-8") from None
    except RecursionError:
        raise BadBody(400, "the request body nests too deeply") from None
    except ValueError as exc:
        raise BadBody(400, f"the request body is not valid JSON: {exc}") from None


def read_body(body: Any, chat: bool, model_name: str) -> tuple[GenerateInput, bool, bool]:
    """A completion (`chat`: chat completion) request's parsed body as the core's GenerateInput, and whether it
    streams and includes usage; BadParameter names the first bad field."""
    if not isinstance(body, dict):
        raise BadParameter("body", "the request body must be a JSON object")
    ignored = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if ignored:
        log.warning("ignored request fields this API does not know: %s%s", ", ".join(map(short, ignored[:8])),
                    f" and {len(ignored) - 8} more" if len(ignored) > 8 else "")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadParameter("model", "model must be a string")
    if model not in (None, model_name):
        raise BadParameter("model", f"The model {short(model)} does not exist; this server serves "
                           f"`{model_name}` (GET /v1/models)", status=404)
    for name, harmless in UNSUPPORTED.items():
        if not harmless(body.get(name)):
            raise BadParameter(name, f"{name} is not supported by pdserve")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BadParameter("n", "only n=1 is supported")
    generate = GenerateInput()
    if chat:
        generate.messages = _chat_messages(body.get("messages"))
    else:
        _completion_prompt(body.get("prompt"), generate)
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
        if name == "temperature":  # checked before float32 rounds it (parse_request): -5e-324 would pass as -0.0
            try:
                check_temperature(value)
            except ValueError as exc:
                raise BadParameter(name, str(exc)) from None
        if kind is int and value >= INTEGER_LIMITS[name]:  # beyond the field's integer width on the wire
            raise BadParameter(name, f"{name} = {value} is out of range")
        if name == "top_k":
            generate.top_k = max(0, int(value))  # -1 (vLLM's "off") is 0 here
        else:
            setattr(generate, name, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
                                 and all(isinstance(s, str) and s for s in stop)):
        raise BadParameter("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS}")
    try:
        check_stop(stop or [])
    except InvalidRequest as exc:
        raise BadParameter("stop", str(exc)) from None
    generate.stop = [unicode_param(s, "stop") for s in stop or []]
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadParameter("ignore_eos", "ignore_eos must be a boolean")
    generate.ignore_eos = ignore_eos
    salt = body.get("cache_salt")  # as vLLM's: a non-empty string when given (its length: parse_request)
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadParameter("cache_salt", "cache_salt must be a non-empty string")
    generate.cache_salt = unicode_param(salt or "", "cache_salt")
    parse_slo(body.get("slo"), generate.slo)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadParameter("stream", "stream must be a boolean")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise BadParameter("stream_options", "stream_options is an object, allowed only with stream: true")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadParameter("stream_options", "stream_options.include_usage must be a boolean")
    return generate, stream, include_usage

def _completion_prompt(prompt: Any, generate: GenerateInput) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        generate.prompt = unicode_param(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt):
        generate.token_ids = prompt
    else:
        raise BadParameter("prompt", "prompt must be a non-empty string or list of token ids (one prompt: "
                           "batches of several are not supported)")

def _chat_messages(messages: Any) -> list[ChatTurn]:
    """OpenAI messages as the gateway's; roles and the chat template are checked where gRPC's are."""
    if not isinstance(messages, list) or not messages:
        raise BadParameter("messages", "messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:  # before each is checked and copied
        raise BadParameter("messages", f"messages holds {len(messages)} messages; at most {MAX_MESSAGES} are "
                           "accepted")
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
        turns.append(ChatTurn(role=unicode_param(message["role"], f"messages[{i}].role"),
                              content=unicode_param(content, f"messages[{i}].content")))
    return turns
