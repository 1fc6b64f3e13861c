"""The OpenAI-compatible API's request bodies: JSON parsed strictly (a repeated key, NaN or a lone surrogate is
refused, not resolved), the fields read, and the parameters refused rather than ignored."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from protos import gateway_pb2

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


def parse_slo(given: Any, slo: gateway_pb2.Slo) -> None:
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
