"""`pdserve bench soak`: a local cluster under a long mixed load, with random cancels and hostile requests, watched
for leaks.

For `--duration` seconds (10 minutes by default) `--concurrency` closed-loop clients each send one request after
another, drawn by a seeded RNG from KINDS: streams and whole completions over gRPC and the OpenAI HTTP API, short
prompts (prefilled by the decode worker) and long ones (prefill worker, KV transfer), streams cancelled at a random
moment, cancelled by id or abandoned mid-read, deadlines that expire, and hostile requests (oversized stop strings,
bad, extreme or denormal floats, out-of-range and negative token ids, invalid JSON and UTF-8, unknown and
duplicate fields, oversized bodies, slow and abandoned uploads...). Every kind names the outcomes it may get (a
precise gRPC status, an HTTP status, or "abandoned" where the client leaves); any other (HTTP 500, UNKNOWN,
INTERNAL, a client-side timeout, a dropped connection) is counted as unexpected.

Every `--sample-every` seconds each process's RSS (VmRSS) and open descriptors (/proc/PID/fd) are sampled. Once
the load stops, the live gauges (each service's pdserve_live_* and queued gauges, and the workers' GetInfo counts)
must read 0 within `--drain-timeout` seconds. The verdict, against issue 21's figures:
- warm-up is the first `--warmup` seconds (default: 20% of the run);
- RSS: no process's RSS grows by more than 5% from just after warm-up to the end of the load. Each level is the
  floor of a window (20% of the run, at least 5 samples): its samples' 10th percentile. A leak raises the floor;
  a passing peak (a batch's activations, a burst of transfers) does not, nor does the heap's churn: protobuf's
  Python runtime calls malloc_trim(0) every 10,000 frees of its arenas, which hands the heap's free pages back,
  and the process touches them again until the next trim (a sawtooth of ~10 MB in the gateway, a 15% swing of a
  window's median there). RSS is taken net of the bytes the bounded caches report holding (CACHE_GAUGES: the
  prefill worker's prefix cache pool fills to its --prefix-cache-mb, 512 MB by default, over the first minutes of
  a soak, and the gateway's prefix index to 200,000 names per prefill worker; that is no leak). Raw RSS levels and
  peaks are reported beside it;
- fds: no process's most open descriptors after warm-up exceed its most during warm-up by more than `--fd-slack`;
- the live gauges reach 0; no unexpected status; no service exited.
The exit status is 0 when the verdict is ok, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.protowire import field, varint, varint_field
from bench.report import add_output_args, publish
from bench.scenarios import percentile
from model_runner.loading import resolve_model
from pdserve.cluster import Cluster, ClusterConfig, Service, start
from protos import decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc, worker_pb2
from serving.metrics import scrape
from serving.models import DEFAULT_MODEL

RSS_GROWTH_LIMIT = 0.05  # issue 21: RSS grows by at most 5% after warm-up
HOSTILE_SHARE = 0.3  # of the requests drawn; each is quick, so they take far less of the time
REQUEST_TIMEOUT_S = 120.0  # a request not done by then is a hang, counted as unexpected ("TIMEOUT")
# What reads 0 when nothing is in flight: every pdserve_live_* gauge, the queues, and the workers' GetInfo counts.
# (Caches such as the prefix cache's pool and the mapped segments are kept on purpose.)
HELD_GAUGES = ("pdserve_queued_requests", "pdserve_queued_tokens", "pdserve_num_requests_waiting",
               "pdserve_num_requests_running")
HELD_INFO = ("live_reservations", "live_sequences", "live_kv_bytes", "live_buffer_bytes", "live_transfers",
             "queued_tokens")
# Bytes held on purpose, each bounded by a flag (--prefix-cache-mb; decode's segments): RSS that grows with them is
# a cache filling, not a leak. Sampled and reported beside RSS.
CACHE_GAUGES = ("pdserve_prefix_cache_pool_bytes", "pdserve_mapped_segment_bytes", "pdserve_prefix_index_bytes")
# A soak whose gauges did not drain keeps polling this long more, to report whether they drain by themselves
LATE_DRAIN_S = 45.0
RSS_LEVEL_PERCENTILE = 10  # a window's level: its floor, which a leak raises and the heap's churn does not
WORDS = "the river carried silver light past the old mill while children counted boats".split()


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory or %(default)r")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds at the start not judged for growth (default: 20%% of --duration)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the load's RNG seed (default: %(default)s)")
    parser.add_argument("--sample-every", type=float, default=5.0,
                        help="seconds between RSS/fd samples (default: %(default)s)")
    parser.add_argument("--fd-slack", type=int, default=8,
                        help="open fds a process may add after warm-up over its warm-up peak (default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=10.0,
                        help="seconds the live gauges get to reach 0 once the load stops (default: %(default)s)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (default: %(default)s)")
    add_output_args(parser, "soak")


# --- the load --------------------------------------------------------------------------------------------------


_NOTES: contextvars.ContextVar[list[str]] = contextvars.ContextVar("notes")


def _note(message: str) -> None:
    """Keep an error message for the report, should the request's outcome be unexpected."""
    notes = _NOTES.get(None)
    if notes is not None:
        notes.append(message[:200])


@dataclass(frozen=True)
class Facts:
    """What the requests are shaped by: the cluster's addresses and the model's limits."""

    grpc: str
    http: str  # host:port of the OpenAI API
    vocab_size: int
    max_model_len: int
    colocate_below: int


class Load:
    """One soak's clients: a gRPC channel and an HTTP session shared by `concurrency` loops."""

    def __init__(self, facts: Facts, channel: grpc.aio.Channel, session: aiohttp.ClientSession, seed: int,
                 hostile_kinds: list[str] | None = None) -> None:
        self.facts, self.channel, self.session = facts, channel, session
        self.hostile_kinds = sorted(name for name, kind in KINDS.items() if not kind.weight) \
            if hostile_kinds is None else hostile_kinds
        self.order = random.Random(f"{seed}:hostile")  # the hostile kinds' turns: each once per shuffled round
        self.hostile_turns: list[str] = []
        self.stub = gateway_pb2_grpc.GatewayStub(channel)
        self.raw_generate = channel.unary_stream("/pdserve.v1.Gateway/Generate",
                                                 response_deserializer=gateway_pb2.GenerateResponse.FromString)
        self.outcomes: dict[str, dict[str, int]] = {}
        self.unexpected: list[dict[str, Any]] = []
        self.refusals: list[tuple[float, str]] = []  # (milliseconds, kind): each hostile request's refusal
        self.ids = 0

    def request_id(self, rng: random.Random) -> str:
        self.ids += 1
        return f"soak-{self.ids}-{rng.getrandbits(32):08x}"

    def draw(self, rng: random.Random) -> str:
        ordinary = [name for name, kind in KINDS.items() if kind.weight]
        weights = [KINDS[name].weight for name in ordinary]
        hostile = sum(weights) * HOSTILE_SHARE / (1 - HOSTILE_SHARE)
        name = rng.choices([*ordinary, ""], [*weights, hostile])[0]
        return name or self.next_hostile()

    def next_hostile(self) -> str:
        """The next of `hostile_kinds` in turn: each once per shuffled round."""
        if not self.hostile_turns:
            self.hostile_turns = list(self.hostile_kinds)
            self.order.shuffle(self.hostile_turns)
        return self.hostile_turns.pop()

    async def one(self, rng: random.Random) -> None:
        name = self.draw(rng)
        kind = KINDS[name]
        started = time.perf_counter()
        notes: list[str] = []
        _NOTES.set(notes)  # this request's error messages; tasks it starts share the list
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                outcome = await kind.run(self, rng)
        except TimeoutError:
            outcome = "TIMEOUT"
        except (aiohttp.ClientError, OSError) as exc:
            outcome = f"ERROR {type(exc).__name__}"
            _note(str(exc))
        elapsed_ms = (time.perf_counter() - started) * 1000
        counts = self.outcomes.setdefault(name, {})
        counts[outcome] = counts.get(outcome, 0) + 1
        detail = notes[-1] if notes else ""
        if outcome not in kind.expected:
            self.unexpected.append({"kind": name, "outcome": outcome, "expected": sorted(kind.expected),
                                    "detail": detail, "ms": round(elapsed_ms, 1)})
        elif not kind.weight and outcome not in SERVED and name != "grpc_duplicate_id":  # that one waits first
            self.refusals.append((elapsed_ms, name))

    # gRPC

    def prompt_ids(self, rng: random.Random, low: int, high: int) -> list[int]:
        return [rng.randrange(100, self.facts.vocab_size) for _ in range(rng.randrange(low, high))]

    def short(self, rng: random.Random, **fields: Any) -> gateway_pb2.GenerateRequest:
        fields.setdefault("token_ids", self.prompt_ids(rng, 4, min(200, self.facts.colocate_below)))
        fields.setdefault("max_tokens", rng.randrange(2, 33))
        fields.setdefault("temperature", rng.choice((0.0, 0.7, 1.0)))
        return gateway_pb2.GenerateRequest(seed=rng.getrandbits(32), **fields)

    async def stream(self, request: gateway_pb2.GenerateRequest | bytes, *, cancel_after_s: float | None = None,
                     timeout_s: float | None = None, on_first: Callable[[], Awaitable[None]] | None = None) -> str:
        """Read a Generate stream to its end: the status's name. `cancel_after_s`: the client cancels then."""
        call = (self.raw_generate if isinstance(request, bytes) else self.stub.Generate)(request, timeout=timeout_s)

        async def read() -> str:
            first = True
            async for _ in call:
                if first and on_first is not None:
                    first = False
                    await on_first()
            return "OK"

        reading = asyncio.ensure_future(read())
        cancelled = False
        if cancel_after_s is not None:
            await asyncio.wait([reading], timeout=cancel_after_s)
            if not reading.done():
                cancelled = call.cancel()
        try:
            return await reading
        except grpc.aio.AioRpcError as exc:
            _note(exc.details() or "")
            return exc.code().name
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not cancelled or (task is not None and task.cancelling()):  # not (only) our own call.cancel()
                raise
            return "CANCELLED"

    async def unary_cancel(self, request_id: str) -> str:
        try:
            await self.stub.Cancel(gateway_pb2.CancelRequest(request_id=request_id), timeout=10)
            return "OK"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    # HTTP

    def body(self, rng: random.Random, chat: bool, **fields: Any) -> dict[str, Any]:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 60)))
        base: dict[str, Any] = {"max_tokens": rng.randrange(2, 25), "temperature": rng.choice((0.0, 0.8))}
        base.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        return {**base, **fields}

    async def post(self, body: Any, chat: bool = False, raw: bytes | None = None,
                   headers: dict[str, str] | None = None, read_events: int | None = None) -> str:
        """POST to the completions route: "HTTP <status>" (", error <code>" when a stream ends with an error event,
        ", unfinished" when it ends without [DONE]); "abandoned" when `read_events` events were read and the client
        left."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        data = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
        async with self.session.post(f"http://{self.facts.http}{path}", data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})}) as response:
            status = f"HTTP {response.status}"
            if response.status != 200 or not response.headers.get("Content-Type", "").startswith("text/event-stream"):
                _note((await response.read())[:200].decode(errors="replace"))
                return status
            events, done = 0, False
            async for line in response.content:
                if read_events is not None and events >= read_events:
                    response.close()  # leave mid-stream: the connection drops
                    return "abandoned"
                if not line.startswith(b"data: "):
                    continue
                events += 1
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True
                elif payload.startswith(b'{"error"'):
                    return f"{status}, error {json.loads(payload)['error'].get('code')}"
            return status if done else f"{status}, unfinished"

    async def raw_http(self, head: str, body: bytes, close_after_body: bool = False) -> str:
        """Send bytes on a fresh connection; "abandoned" when the client closes without waiting for a reply."""
        reader, writer = await asyncio.open_connection(*self.facts.http.rsplit(":", 1))
        try:
            writer.write(head.encode() + body)
            await writer.drain()
            if close_after_body:
                return "abandoned"
            line = await reader.readline()
            return f"HTTP {line.split()[1].decode()}" if line.startswith(b"HTTP/") else "ERROR no status line"
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def head(self, length: int, path: str = "/v1/completions") -> str:
        return (f"POST {path} HTTP/1.1\r\nHost: {self.facts.http}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n")


Run = Callable[[Load, random.Random], Awaitable[str]]


@dataclass(frozen=True)
class Kind:
    expected: frozenset[str]  # the outcomes it may get; any other is unexpected
    run: Run
    weight: float = 0.0  # its share of the ordinary draws; 0: hostile, run in turn with the other hostile kinds


GRPC_OK = frozenset({"OK", "RESOURCE_EXHAUSTED"})  # admission may refuse under load: a precise, expected status
HTTP_OK = frozenset({"HTTP 200", "HTTP 429"})
SERVED = frozenset({"OK", "HTTP 200", "abandoned"})  # outcomes of a hostile request that are no refusal
INVALID = frozenset({"INVALID_ARGUMENT"})
HTTP_400 = frozenset({"HTTP 400"})
KINDS: dict[str, Kind] = {}


def kind(expected: frozenset[str], weight: float = 0.0) -> Callable[[Run], Run]:
    """Registers a kind of request under its function's name; without a weight, a hostile one."""
    def register(run: Run) -> Run:
        KINDS[run.__name__] = Kind(expected, run, weight)
        return run
    return register


def refusal(name: str, expected: frozenset[str], build: Callable[[Load, random.Random], Any],
            transport: str = "grpc", chat: bool = False) -> None:
    """A hostile request that must be refused (or served, where `expected` says so): one gRPC request or HTTP
    body, built per call."""
    async def run(load: Load, rng: random.Random) -> str:
        if transport == "grpc":
            return await load.stream(build(load, rng), timeout_s=60)
        built = build(load, rng)
        return await load.post(None, chat, raw=built) if isinstance(built, bytes) else await load.post(built, chat)
    KINDS[name] = Kind(expected, run)


# The ordinary load: most of the time and tokens.

@kind(GRPC_OK, weight=20)
async def grpc_stream(load: Load, rng: random.Random) -> str:
    stop = [rng.choice(WORDS)] if rng.random() < 0.2 else []
    return await load.stream(load.short(rng, stop=stop, ignore_eos=rng.random() < 0.5))


@kind(GRPC_OK, weight=5)
async def grpc_long_prompt(load: Load, rng: random.Random) -> str:
    """Past --colocate-below: prefilled by the prefill worker, its KV sent to decode."""
    low = load.facts.colocate_below
    high = min(low + 1024, load.facts.max_model_len - 16)
    return await load.stream(load.short(rng, token_ids=load.prompt_ids(rng, low, high), max_tokens=8))


@kind(GRPC_OK, weight=8)
async def grpc_chat(load: Load, rng: random.Random) -> str:
    messages = [gateway_pb2.ChatMessage(role="user", content=" ".join(rng.choices(WORDS, k=12)))]
    return await load.stream(load.short(rng, token_ids=None, messages=messages))


@kind(HTTP_OK, weight=12)
async def http_stream(load: Load, rng: random.Random) -> str:
    chat = rng.random() < 0.5
    return await load.post(load.body(rng, chat, stream=True, stream_options={"include_usage": True}), chat)


@kind(HTTP_OK, weight=6)
async def http_whole(load: Load, rng: random.Random) -> str:
    chat = rng.random() < 0.5
    return await load.post(load.body(rng, chat), chat)


# Cancels: the client leaves at a random moment (queued, prefilling, transferring or decoding).

@kind(GRPC_OK | {"CANCELLED"}, weight=10)
async def grpc_cancel(load: Load, rng: random.Random) -> str:
    long = rng.random() < 0.3
    low = load.facts.colocate_below
    ids = load.prompt_ids(rng, low, min(low + 256, load.facts.max_model_len - 48)) if long else None
    request = load.short(rng, max_tokens=48) if ids is None else load.short(rng, token_ids=ids, max_tokens=48)
    return await load.stream(request, cancel_after_s=rng.uniform(0, 1.5))


@kind(GRPC_OK | {"CANCELLED"}, weight=4)
async def grpc_cancel_by_id(load: Load, rng: random.Random) -> str:
    request_id = load.request_id(rng)
    reading = asyncio.ensure_future(load.stream(load.short(rng, request_id=request_id, max_tokens=48)))
    await asyncio.wait([reading], timeout=rng.uniform(0, 1.5))
    cancelled = await load.unary_cancel(request_id)
    status = await reading
    return status if cancelled == "OK" else f"Cancel {cancelled}"


@kind(GRPC_OK | {"DEADLINE_EXCEEDED"}, weight=2)
async def grpc_short_deadline(load: Load, rng: random.Random) -> str:
    return await load.stream(load.short(rng, max_tokens=16), timeout_s=rng.uniform(0.001, 0.5))


@kind(HTTP_OK | {"abandoned"}, weight=8)
async def http_abandoned_stream(load: Load, rng: random.Random) -> str:
    chat = rng.random() < 0.5
    return await load.post(load.body(rng, chat, stream=True, max_tokens=40), chat, read_events=rng.randrange(0, 4))


@kind(frozenset({"abandoned"}))
async def http_abandoned_upload(load: Load, rng: random.Random) -> str:
    body = json.dumps(load.body(rng, False)).encode()
    return await load.raw_http(load.head(len(body)), body[: len(body) // 2], close_after_body=True)


@kind(HTTP_OK)
async def http_slow_body(load: Load, rng: random.Random) -> str:
    """A valid body trickled over about a second (a slowloris client, cut short)."""
    body = json.dumps(load.body(rng, False)).encode()

    async def trickle() -> Any:
        for i in range(0, len(body), max(1, len(body) // 8)):
            await asyncio.sleep(0.12)
            yield body[i : i + max(1, len(body) // 8)]

    async with load.session.post(f"http://{load.facts.http}/v1/completions", data=trickle(),
                                 headers={"Content-Type": "application/json"}) as response:
        await response.read()
        return f"HTTP {response.status}"


@kind(frozenset({"ALREADY_EXISTS"}))
async def grpc_duplicate_id(load: Load, rng: random.Random) -> str:
    """A second request with the id of one in flight."""
    request_id = load.request_id(rng)
    second: list[str] = []

    async def duplicate() -> None:
        second.append(await load.stream(load.short(rng, request_id=request_id), timeout_s=60))

    first = await load.stream(load.short(rng, request_id=request_id, max_tokens=32, ignore_eos=True),
                              on_first=duplicate, cancel_after_s=30)
    return second[0] if second else f"first {first}, no duplicate sent"


@kind(frozenset({"OK", "NOT_FOUND"}))
async def grpc_cancel_unknown_id(load: Load, rng: random.Random) -> str:
    return await load.unary_cancel(load.request_id(rng))


@kind(INVALID)
async def grpc_cancel_empty_id(load: Load, rng: random.Random) -> str:
    return await load.unary_cancel("")


Fields = Callable[[Facts], dict[str, Any]]
_BIG = 1 << 32
_OK = frozenset({"OK"})
# gRPC: each field's checks, the floats at their extremes, the prompt's size and ids. Each request starts from
# _defaults; a field set to None is left out.
GRPC_FIELDS: list[tuple[str, frozenset[str], Fields]] = [
    ("grpc_stop_huge", INVALID, lambda f: {"stop": ["x" * 300_000]}),
    ("grpc_stop_many", INVALID, lambda f: {"stop": [f"s{i}" for i in range(17)]}),
    ("grpc_stop_empty", INVALID, lambda f: {"stop": [""]}),
    ("grpc_temperature_tiny", _OK, lambda f: {"temperature": 1e-40}),  # a float32 denormal: greedy
    ("grpc_temperature_nan", INVALID, lambda f: {"temperature": math.nan}),
    ("grpc_temperature_inf", INVALID, lambda f: {"temperature": math.inf}),
    ("grpc_temperature_negative", INVALID, lambda f: {"temperature": -0.5}),
    ("grpc_top_p_zero", INVALID, lambda f: {"top_p": 0.0}),
    ("grpc_top_p_denormal", _OK, lambda f: {"top_p": 1e-44, "temperature": 1.0}),
    ("grpc_top_k_huge", _OK, lambda f: {"top_k": _BIG - 1, "temperature": 1.0}),
    ("grpc_seed_max", _OK, lambda f: {"seed": (1 << 64) - 1, "temperature": 1.0}),
    ("grpc_token_id_vocab", INVALID, lambda f: {"token_ids": [5, f.vocab_size]}),
    ("grpc_token_id_max", INVALID, lambda f: {"token_ids": [_BIG - 1]}),
    ("grpc_prompt_too_long", INVALID, lambda f: {"token_ids": [7] * f.max_model_len}),
    ("grpc_prompt_huge_text", INVALID, lambda f: {"token_ids": None, "prompt": "word " * 400_000}),
    ("grpc_empty", INVALID, lambda f: {"token_ids": None, "max_tokens": None, "temperature": None}),
    ("grpc_two_prompts", INVALID, lambda f: {"prompt": "two prompts"}),
    ("grpc_max_tokens_zero", INVALID, lambda f: {"max_tokens": 0}),
    ("grpc_max_tokens_huge", INVALID, lambda f: {"max_tokens": _BIG - 1}),
    ("grpc_request_id_long", INVALID, lambda f: {"request_id": "r" * 200}),
    ("grpc_request_id_newline", INVALID, lambda f: {"request_id": "forged\nINFO log line"}),
    ("grpc_chat_bad_role", INVALID,
     lambda f: {"token_ids": None, "messages": [gateway_pb2.ChatMessage(role="root", content="hi")]}),
    ("grpc_chat_huge_array", INVALID,
     lambda f: {"token_ids": None, "messages": [gateway_pb2.ChatMessage(role="user", content="")] * 3000}),
]
# Bytes no pdserve client would send: invalid UTF-8 in a string field, an unknown field, a repeated scalar
# (proto3: the last wins), and bytes that are no protobuf at all.
GRPC_BYTES: list[tuple[str, frozenset[str], bytes]] = [
    ("grpc_invalid_utf8", INVALID, field(1, 2, b"caf\xc3(\xff") + varint_field(3, 4)),
    ("grpc_unknown_field", _OK, field(2, 2, varint(42)) + varint_field(3, 2) + field(99, 2, b"extra")),
    ("grpc_repeated_scalar", _OK, field(2, 2, varint(42)) + varint_field(3, 999) + varint_field(3, 2)),
    ("grpc_not_protobuf", INVALID, b"\xff\xff\xff\xff\x0f"),
]
# HTTP: bodies that are not JSON, not an object, or abuse JSON (the bool: the chat route).
HTTP_BODIES: list[tuple[str, frozenset[str], bytes, bool]] = [
    ("http_not_json", HTTP_400, b'{"prompt": "unterminated', False),
    ("http_not_object", HTTP_400, b"[1, 2, 3]", False),
    ("http_duplicate_key", HTTP_400, b'{"prompt": "a", "max_tokens": 2, "max_tokens": 900000}', False),
    ("http_nan", HTTP_400, b'{"prompt": "a", "temperature": NaN}', False),
    ("http_float_overflow", HTTP_400, b'{"prompt": "a", "temperature": 1e999}', False),
    ("http_temperature_denormal", frozenset({"HTTP 200"}),
     b'{"prompt": "a", "max_tokens": 2, "temperature": 5e-324}', False),
    ("http_deep_nesting", HTTP_400, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", False),
    ("http_invalid_utf8", HTTP_400, b'{"prompt": "caf\xc3(\xff", "max_tokens": 2}', False),
    ("http_lone_surrogate", HTTP_400, b'{"prompt": "a\\ud800b", "max_tokens": 2}', False),
    ("http_lone_surrogate_chat", HTTP_400,
     b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', True),
]
# HTTP: each field's checks, over a valid body (Load.body).
HTTP_FIELDS: list[tuple[str, frozenset[str], Fields, bool]] = [
    ("http_stop_huge", HTTP_400, lambda f: {"stop": ["x" * 300_000]}, False),
    ("http_stop_not_string", HTTP_400, lambda f: {"stop": [5]}, False),
    ("http_temperature_string", HTTP_400, lambda f: {"temperature": "hot"}, False),
    ("http_temperature_big", HTTP_400, lambda f: {"temperature": 1e300}, True),
    ("http_token_ids_negative", HTTP_400, lambda f: {"prompt": [5, -1]}, False),
    ("http_token_ids_vocab", HTTP_400, lambda f: {"prompt": [5, f.vocab_size]}, False),
    ("http_token_ids_huge", HTTP_400, lambda f: {"prompt": [1 << 40]}, False),
    ("http_token_ids_floats", HTTP_400, lambda f: {"prompt": [1.5, 2.0]}, False),
    ("http_max_tokens_negative", HTTP_400, lambda f: {"max_tokens": -1}, False),
    ("http_max_tokens_huge", HTTP_400, lambda f: {"max_tokens": 1 << 70}, True),
    ("http_seed_huge", HTTP_400, lambda f: {"seed": 1 << 80}, False),
    ("http_unknown_fields", frozenset({"HTTP 200"}),
     lambda f: {"max_tokens": 2, "frobnicate": True, "x" * 200: [1] * 100}, False),
    ("http_unknown_model", frozenset({"HTTP 404"}), lambda f: {"model": "gpt-17"}, False),
    ("http_n_two", HTTP_400, lambda f: {"n": 2}, False),
    ("http_logprobs", HTTP_400, lambda f: {"logprobs": 5}, False),
    ("http_stream_options_without_stream", HTTP_400, lambda f: {"stream_options": {"include_usage": True}}, True),
    ("http_chat_huge_array", HTTP_400, lambda f: {"messages": [{"role": "user", "content": "a"}] * 3000}, True),
    ("http_chat_bad_role", HTTP_400, lambda f: {"messages": [{"role": "wizard", "content": "a"}]}, True),
    ("http_chat_image", HTTP_400, lambda f: {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, True),
    ("http_chat_empty", HTTP_400, lambda f: {"messages": []}, True),
    ("http_prompt_huge", HTTP_400, lambda f: {"prompt": "word " * 200_000}, False),
]


def _grpc_request(fields: Fields) -> Callable[[Load, random.Random], gateway_pb2.GenerateRequest]:
    def build(load: Load, rng: random.Random) -> gateway_pb2.GenerateRequest:
        merged = {**_defaults(load, rng), **fields(load.facts)}
        return gateway_pb2.GenerateRequest(**{k: v for k, v in merged.items() if v is not None})
    return build


def _http_body(fields: Fields, chat: bool) -> Callable[[Load, random.Random], dict[str, Any]]:
    return lambda load, rng: load.body(rng, chat, **fields(load.facts))


def _constant(raw: bytes) -> Callable[[Load, random.Random], bytes]:
    return lambda load, rng: raw


def _hostile_corpus() -> None:
    for name, expected, fields in GRPC_FIELDS:
        refusal(name, expected, _grpc_request(fields))
    for name, expected, raw in GRPC_BYTES:
        refusal(name, expected, _constant(raw))
    for name, expected, body, chat in HTTP_BODIES:
        refusal(name, expected, _constant(body), transport="http", chat=chat)
    for name, expected, http_fields, chat in HTTP_FIELDS:
        refusal(name, expected, _http_body(http_fields, chat), transport="http", chat=chat)


def _defaults(load: Load, rng: random.Random) -> dict[str, Any]:
    return {"token_ids": load.prompt_ids(rng, 4, 32), "max_tokens": 4, "temperature": 0.0}


@kind(frozenset({"HTTP 413"}))
async def http_body_too_large(load: Load, rng: random.Random) -> str:
    """Announces 64 MiB: refused by its Content-Length, before the body is read."""
    return await load.raw_http(load.head(64 << 20), b'{"prompt": "' + b"a" * 1024)


@kind(frozenset({"HTTP 404"}))
async def http_unknown_route(load: Load, rng: random.Random) -> str:
    return await load.raw_http(load.head(2, "/v1/engines/davinci/completions"), b"{}")


@kind(frozenset({"HTTP 405"}))
async def http_wrong_method(load: Load, rng: random.Random) -> str:
    return await load.raw_http(f"GET /v1/completions HTTP/1.1\r\nHost: {load.facts.http}\r\n\r\n", b"")


@kind(HTTP_400)
async def http_request_id_long(load: Load, rng: random.Random) -> str:
    return await load.post(load.body(rng, False), headers={"X-Request-Id": "r" * 300})


_hostile_corpus()


async def drive(facts: Facts, args: argparse.Namespace) -> Load:
    """`--concurrency` loops, each sending one request after another until `--duration` has passed; the requests in
    flight then finish (each is bounded by REQUEST_TIMEOUT_S)."""
    async with grpc.aio.insecure_channel(facts.grpc) as channel, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=10),
            connector=aiohttp.TCPConnector(limit=0)) as session:
        load = Load(facts, channel, session, args.seed)
        end = time.monotonic() + args.duration

        async def loop(index: int) -> None:
            rng = random.Random(f"{args.seed}:{index}")
            while time.monotonic() < end:
                await load.one(rng)

        await asyncio.gather(*(loop(i) for i in range(args.concurrency)))
        return load


# --- what the processes hold ----------------------------------------------------------------------------------


def _rss_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return None if kib is None else round(kib / 1024, 2)


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class Sampler(threading.Thread):
    """Every `every_s`, each process's RSS, open fds and bytes in bounded caches (CACHE_GAUGES, which tell a cache
    filling from a leak), and the requests live at the gateway; on a thread, so a busy event loop skips no
    sample."""

    def __init__(self, services: dict[str, Service], every_s: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.services, self.every_s = services, every_s
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self.t_s: list[float] = []
        self.rss_mb: dict[str, list[float | None]] = {name: [] for name in services}
        self.fds: dict[str, list[int | None]] = {name: [] for name in services}
        self.cache_mb: dict[str, list[float | None]] = {name: [] for name in services}
        self.live_requests: list[float | None] = []

    def sample(self) -> None:
        self.t_s.append(round(time.monotonic() - self.started, 2))
        for name, service in self.services.items():
            self.rss_mb[name].append(_rss_mb(service.process.pid))
            self.fds[name].append(_fds(service.process.pid))
            try:
                metrics = scrape(service.metrics)
            except OSError:
                metrics = None
            self.cache_mb[name].append(None if metrics is None else
                                       round(sum(metrics.get(key, 0.0) for key in CACHE_GAUGES) / 2**20, 2))
            if name == "gateway":
                self.live_requests.append(None if metrics is None else metrics.get("pdserve_live_requests"))

    def run(self) -> None:
        self.sample()
        while not self.stopping.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.sample()  # the last, once the gauges have drained


def _names(cluster: Cluster) -> dict[str, Service]:
    return {"gateway": cluster.gateway, **{f"prefill-{i}": s for i, s in enumerate(cluster.prefill)},
            **{f"decode-{i}": s for i, s in enumerate(cluster.decode)}}


def live_gauges(cluster: Cluster) -> dict[str, dict[str, float]]:
    """Per process, every count that is 0 when nothing is in flight: the live and queue gauges of /metrics
    (`metrics.`) and the workers' GetInfo counts (`info.`)."""
    values: dict[str, dict[str, float]] = {}
    for name, service in _names(cluster).items():
        samples = scrape(service.metrics)
        values[name] = {f"metrics.{key}": value for key, value in samples.items()
                        if key.startswith("pdserve_live_") or key in HELD_GAUGES}
        if service.role != "gateway":
            stub = (prefill_pb2_grpc.PrefillStub if service.role == "prefill" else decode_pb2_grpc.DecodeStub)
            with cluster.channel(service) as channel:
                info = stub(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5)
            values[name].update({f"info.{field}": float(getattr(info, field)) for field in HELD_INFO})
    return values


def drain(cluster: Cluster, timeout_s: float) -> tuple[float | None, dict[str, dict[str, float]]]:
    """Seconds until every live gauge reads 0 (None: not within `timeout_s`), and the values last read."""
    started = time.monotonic()
    while True:
        values = live_gauges(cluster)
        if not any(v for gauges in values.values() for v in gauges.values()):
            return round(time.monotonic() - started, 3), values
        if time.monotonic() - started > timeout_s:
            return None, values
        time.sleep(0.05)


def _net(rss: list[float | None], cache: list[float | None]) -> list[float | None]:
    """RSS less the bytes held in bounded caches, per sample (None where either could not be read)."""
    return [None if r is None or c is None else round(r - c, 2) for r, c in zip(rss, cache)]


def judge(sampler: Sampler, warmup_s: float, end_s: float, window_s: float,
          fd_slack: int) -> dict[str, dict[str, Any]]:
    """Per process: RSS growth, from its level just after warm-up to its level at `end_s` (each the floor,
    RSS_LEVEL_PERCENTILE, of the samples in a `window_s` window: a leak raises it, a passing peak and the heap's
    churn do not), net of caches (a prefix cache filling to its --prefix-cache-mb is no leak); raw RSS and fd peaks
    during and after warm-up; and whether each stayed within its bound."""
    def values(series: list[Any], low: float, high: float) -> list[Any]:
        return [v for t, v in zip(sampler.t_s, series) if low < t <= high and v is not None]

    def peak(series: list[Any], low: float, high: float) -> Any:
        return max(values(series, low, high), default=None)

    def level(series: list[Any], low: float, high: float) -> float | None:
        found = values(series, low, high)
        return round(percentile(found, RSS_LEVEL_PERCENTILE), 2) if found else None

    verdicts: dict[str, dict[str, Any]] = {}
    for name in sampler.services:
        rss, fds = sampler.rss_mb[name], sampler.fds[name]
        net = _net(rss, sampler.cache_mb[name])
        start = level(net, warmup_s, warmup_s + window_s)
        end = level(net, end_s - window_s, end_s)
        growth = round(end / start - 1, 4) if start and end else None
        rss_warm, rss_after = peak(rss, -1, warmup_s), peak(rss, warmup_s, math.inf)
        fds_warm, fds_after = peak(fds, -1, warmup_s), peak(fds, warmup_s, math.inf)
        verdicts[name] = {
            "pid": sampler.services[name].process.pid, "exit_code": sampler.services[name].process.poll(),
            "net_rss_mb_after_warmup": start, "net_rss_mb_at_end": end, "net_rss_growth": growth,
            "rss_mb_after_warmup": level(rss, warmup_s, warmup_s + window_s),
            "rss_mb_at_end": level(rss, end_s - window_s, end_s),
            "rss_mb_warmup_peak": rss_warm, "rss_mb_peak_after_warmup": rss_after,
            "cache_mb_end": sampler.cache_mb[name][-1],
            "fds_warmup_peak": fds_warm, "fds_peak_after_warmup": fds_after, "fds_end": fds[-1],
            "rss_ok": growth is not None and growth <= RSS_GROWTH_LIMIT,
            "fds_ok": fds_warm is not None and fds_after is not None and fds_after <= fds_warm + fd_slack,
        }
    return verdicts


# --- the run --------------------------------------------------------------------------------------------------


def model_context(model_dir: Path) -> int:
    try:
        return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError):
        return 2048


@contextlib.contextmanager
def stderr_to(fd: int) -> Iterator[None]:
    """This process's stderr goes to `fd` while the services start, so theirs does for good."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    if args.duration <= 0 or args.concurrency < 1 or args.sample_every <= 0:
        raise SystemExit("pdserve bench soak: --duration, --concurrency and --sample-every must be positive")
    warmup_s = args.duration * 0.2 if args.warmup is None else args.warmup
    window_s = max(5 * args.sample_every, 0.2 * args.duration)  # RSS levels: floors over this many seconds
    model = resolve_model(args.model)
    # `pdserve cluster`'s 512, or half the context of a model too small for it: long prompts still reach the
    # prefill worker and move their KV
    colocate_below = min(512, model_context(model) // 2)
    log = tempfile.NamedTemporaryFile("w", prefix="pdserve-bench-soak-", suffix=".log", delete=False)
    print(f"bench soak: starting a cluster ({args.prefill} prefill, {args.decode} decode) on {model} (its logs: "
          f"{log.name})", file=sys.stderr, flush=True)
    with log, stderr_to(log.fileno()):  # the services inherit it: a soak's logs are long
        cluster = start(ClusterConfig(prefill=args.prefill, decode=args.decode, model=str(model),
                                      startup_timeout_s=300, colocate_below=colocate_below))
    try:
        with cluster.channel(cluster.decode[0]) as channel:
            info = decode_pb2_grpc.DecodeStub(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=10)
        facts = Facts(cluster.gateway.address, cluster.gateway.http, info.model.vocab_size, info.model.max_model_len,
                      colocate_below)
        sampler = Sampler(_names(cluster), args.sample_every)
        print(f"bench soak: {args.duration:g} s of load, {args.concurrency} at a time (warm-up: the first "
              f"{warmup_s:g} s)", file=sys.stderr, flush=True)
        sampler.start()
        load = asyncio.run(drive(facts, args))
        load_s = time.monotonic() - sampler.started
        drained_s, gauges = drain(cluster, args.drain_timeout)
        late_s = None
        if drained_s is None:  # held: whether it ends by itself (decode's lease, 30 s), for the report
            late, _ = drain(cluster, LATE_DRAIN_S)
            late_s = None if late is None else round(args.drain_timeout + late, 3)
        sampler.stop()
        # the end level is taken under full load, before the requests in flight wind down
        processes = judge(sampler, warmup_s, min(load_s, args.duration), window_s, args.fd_slack)
    finally:
        cluster.stop()
    result = _report(args, warmup_s, window_s, colocate_below, load, load_s, drained_s, gauges, processes, sampler)
    if drained_s is None:
        result["drained_late_s"], result["worker_warnings"] = late_s, _worker_warnings(log.name)
    publish(args, "soak", result, lambda: _table(result), lambda path: plot(result, path))
    return 0 if result["verdict"]["ok"] else 1


def _worker_warnings(path: str, most: int = 20) -> list[str]:
    """The workers' last warnings and errors in the soak's log (the gateway's are mostly the hostile load's)."""
    with open(path, errors="replace") as lines:
        found = [line.rstrip() for line in lines
                 if (" WARNING " in line or " ERROR " in line) and " gateway." not in line]
    return found[-most:]


def _report(args: argparse.Namespace, warmup_s: float, window_s: float, colocate_below: int, load: Load, load_s: float,
            drained_s: float | None, gauges: dict[str, dict[str, float]], processes: dict[str, dict[str, Any]],
            sampler: Sampler) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for counts in load.outcomes.values():
        for outcome, n in counts.items():
            statuses[outcome] = statuses.get(outcome, 0) + n
    hostile = sorted(name for name, kind in KINDS.items() if not kind.weight)
    refusal_ms = [ms for ms, _ in load.refusals]
    held = {f"{name} {key}": value for name, values in gauges.items() for key, value in values.items() if value}
    verdict = {
        "rss_growth_within_5pct": all(p["rss_ok"] for p in processes.values()),
        "fds_flat": all(p["fds_ok"] for p in processes.values()),
        "live_gauges_zero": drained_s is not None,
        "no_unexpected_statuses": not load.unexpected,
        "no_service_exited": all(p["exit_code"] is None for p in processes.values()),
    }
    return {
        "config": {"model": str(args.model), "duration_s": args.duration, "warmup_s": warmup_s,
                   "rss_window_s": window_s,
                   "concurrency": args.concurrency, "seed": args.seed, "sample_every_s": args.sample_every,
                   "prefill": args.prefill, "decode": args.decode, "colocate_below": colocate_below,
                   "hostile_share": HOSTILE_SHARE, "rss_growth_limit": RSS_GROWTH_LIMIT, "fd_slack": args.fd_slack,
                   "drain_timeout_s": args.drain_timeout},
        "definitions": {
            "warmup": f"the first {warmup_s:g} s of load (--warmup; default 20% of --duration)",
            "rss": f"each process's RSS net of caches (RSS less {' and '.join(CACHE_GAUGES)}, caches bounded by "
                   f"flags) at the end of the load is at most {1 + RSS_GROWTH_LIMIT:g}x what it was right after "
                   f"warm-up, each the {RSS_LEVEL_PERCENTILE}th percentile (the floor) of the samples over "
                   f"{window_s:g} s (the first {window_s:g} s after warm-up; the last {window_s:g} s of --duration, "
                   "before the requests in flight wind down); "
                   "raw RSS levels and peaks are reported beside it",
            "fds": f"each process's peak open fds after warm-up is at most its peak during it + {args.fd_slack}",
            "gauges": "every pdserve_live_* and queue gauge and every GetInfo live count reads 0 within "
                      f"{args.drain_timeout:g} s of the load's end",
            "unexpected": "an outcome its kind does not list (500, UNKNOWN, INTERNAL, a hang, a dropped connection)",
        },
        "load_s": round(load_s, 1),
        "requests": sum(statuses.values()),
        "statuses": dict(sorted(statuses.items())),
        "by_kind": {name: dict(sorted(load.outcomes.get(name, {}).items())) for name in KINDS},
        "hostile_kinds": len(hostile), "hostile_kinds_run": sum(name in load.outcomes for name in hostile),
        "refusal_ms_p50": round(percentile(refusal_ms, 50), 1) if refusal_ms else None,
        "refusal_ms_p99": round(percentile(refusal_ms, 99), 1) if refusal_ms else None,
        "slowest_refusals": [{"kind": name, "ms": round(ms, 1)} for ms, name in sorted(load.refusals)[-5:][::-1]],
        "unexpected": len(load.unexpected), "unexpected_examples": _examples(load.unexpected),
        "drained_s": drained_s, "held_at_end": held, "live_gauges_end": gauges,
        "processes": processes,
        "samples": {"t_s": sampler.t_s, "rss_mb": sampler.rss_mb, "fds": sampler.fds, "cache_mb": sampler.cache_mb,
                    "gateway_live_requests": sampler.live_requests},
        "verdict": {**verdict, "ok": all(verdict.values())},
    }


def _examples(unexpected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first of each unexpected (kind, outcome), with how many there were."""
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for u in unexpected:
        example = first.setdefault((u["kind"], u["outcome"]), {**u, "count": 0})
        example["count"] += 1
    return list(first.values())


def _pct(value: float | None) -> str:
    return f"{value:+.1%}" if value is not None else "-"


def _table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"{result['requests']} requests in {result['load_s']:g} s ({c['concurrency']} at a time, seed "
             f"{c['seed']}), {result['hostile_kinds_run']}/{result['hostile_kinds']} hostile kinds run; warm-up "
             f"{c['warmup_s']:g} s",
             "statuses: " + ", ".join(f"{k} {v}" for k, v in result["statuses"].items()),
             f"refusals: p50 {result['refusal_ms_p50']} ms, p99 {result['refusal_ms_p99']} ms",
             f"unexpected: {result['unexpected']}" + "".join(
                 f"\n  {u['kind']}: {u['outcome']} x{u['count']} (expected {', '.join(u['expected'])}): "
                 f"{u['detail']}" for u in result["unexpected_examples"]),
             f"live gauges at 0 after {result['drained_s']} s" if result["drained_s"] is not None
             else f"live gauges still held: {result['held_at_end']}",
             f"RSS: floor ({RSS_LEVEL_PERCENTILE}th percentile) over {c['rss_window_s']:g} s right after warm-up -> "
             f"over the last {c['rss_window_s']:g} s of --duration; growth is judged net of caches (prefix cache "
             "pool, mapped segments, prefix index); fds: peak during -> after warm-up",
             f"{'process':<10} {'pid':>7} {'RSS MB':>11} {'cache MB':>8} {'net RSS MB':>11} {'growth':>7} "
             f"{'peak MB':>11} {'fds':>9}"]
    for name, p in result["processes"].items():
        rss = f"{p['rss_mb_after_warmup'] or 0:.0f}->{p['rss_mb_at_end'] or 0:.0f}"
        net = f"{p['net_rss_mb_after_warmup'] or 0:.0f}->{p['net_rss_mb_at_end'] or 0:.0f}"
        peaks = f"{p['rss_mb_warmup_peak'] or 0:.0f}->{p['rss_mb_peak_after_warmup'] or 0:.0f}"
        fds = f"{p['fds_warmup_peak']}->{p['fds_peak_after_warmup']}"
        exited = "" if p["exit_code"] is None else f"  exited with code {p['exit_code']}"
        lines.append(f"{name:<10} {p['pid']:>7} {rss:>11} {p['cache_mb_end'] or 0:>8.0f} {net:>11} "
                     f"{_pct(p['net_rss_growth']):>7} {peaks:>11} {fds:>9}{exited}")
    v = result["verdict"]
    lines.append("verdict: " + ("ok" if v["ok"] else "FAILED: " + ", ".join(k for k, ok in v.items() if not ok
                                                                              and k != "ok")))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS (top; dashed: net of caches; the windows its levels are taken over tinted) and open fds (middle) of each
    process over time, warm-up shaded; requests live at the gateway (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, warmup = result["samples"], result["config"]["warmup_s"]
    figure, (rss, fds, live) = plt.subplots(3, 1, figsize=(10, 9), sharex=True,
                                            gridspec_kw={"height_ratios": [3, 2, 1]})
    for name in samples["rss_mb"]:
        line = rss.plot(samples["t_s"], samples["rss_mb"][name], label=name)[0]
        if any(samples["cache_mb"][name]):
            rss.plot(samples["t_s"], _net(samples["rss_mb"][name], samples["cache_mb"][name]), linestyle="--",
                     color=line.get_color(), label=f"{name}, net of caches")
        fds.plot(samples["t_s"], samples["fds"][name], label=name)
    live.plot(samples["t_s"], samples["gateway_live_requests"], color="grey")
    window, duration = result["config"]["rss_window_s"], result["config"]["duration_s"]
    for axis in (rss, fds, live):
        axis.axvspan(0, warmup, color="0.9", zorder=0)
    for low in (warmup, min(duration, result["load_s"]) - window):  # where the RSS levels are taken
        rss.axvspan(low, low + window, color="tab:olive", alpha=0.12, zorder=0)
    rss.set_ylabel("RSS (MB)")
    failed = [check for check, ok in result["verdict"].items() if not ok and check != "ok"]
    rss.set_title(f"bench soak: {result['config']['duration_s']:g} s, warm-up shaded; verdict "
                  + ("ok" if not failed else "FAILED: " + ", ".join(failed)))
    rss.legend()
    fds.set_ylabel("open fds")
    live.set_ylabel("live requests\n(gateway)")
    live.set_xlabel("seconds since the load started")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
