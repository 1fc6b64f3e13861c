"""Hostile input over both APIs (issue 21): each kind of bad request gets a precise 4xx or gRPC status, never 500,
UNKNOWN or INTERNAL; none that is refused is accepted; nothing is held afterwards; and a bystander's streams get
every token alongside. How fast refusals come and how the bystander's pace holds are `pdserve bench hostile`'s
figures (bench/hostile.py), not this file's.

The corpus test runs as a lifecycle:
1. The corpus runs entry by entry while a bystander streams.
2. Every entry got its expected status, and the gateway accepted only the ones served.
3. The bystander finished every stream it started, each with all its tokens.
4. Leak check: every live gauge is 0, and every worker holds nothing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from bench.protowire import field, varint_field
from gateway.messages import ChatTurn, GenerateInput
from gateway.openai_api import MAX_BODY_BYTES
from gateway.request import MAX_MESSAGES, InvalidRequest, max_prompt_chars, parse_request
from pdserve.cluster import Cluster
from protos import gateway_pb2, gateway_pb2_grpc
from serving.metrics import scrape
from serving.server import MAX_MESSAGE_BYTES
from tests.helpers import assert_nothing_held, assert_nothing_live, start_cluster

BODY_TIMEOUT_S = 0.5  # the gateway's --http-body-timeout here, so that a slowloris body is refused quickly
CONTEXT = 512  # the tiny model's
VOCAB = 49152


@pytest.fixture(scope="module")
def hostile(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = start_cluster(tiny_model_dir, decode_args=("--max-seqs=8",),
                            gateway_args=(f"--http-body-timeout={BODY_TIMEOUT_S}",))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --- the event loop stays free -------------------------------------------------------------------------------------

class WatchedTokenizer:
    """The tokenizer, noting each encode or chat rendering and the thread it ran on. With `loop_ticked`, each one
    first waits until the event loop has run a timer since it began: one holding the loop would wait in vain."""

    def __init__(self, tokenizer: Any, loop_ticked: threading.Event | None = None) -> None:
        self._tokenizer, self._loop_ticked = tokenizer, loop_ticked
        self.calls: list[tuple[str, int]] = []  # (what, thread id)
        self.loop_ran: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def _watch(self, what: str) -> None:
        self.calls.append((what, threading.get_ident()))
        if self._loop_ticked is not None:
            self._loop_ticked.clear()
            self.loop_ran.append(self._loop_ticked.wait(10))

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self._watch(f"encode {len(text)} characters")
        return self._tokenizer.encode(text, *args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._watch("apply_chat_template")
        return self._tokenizer.apply_chat_template(*args, **kwargs)


async def _beside_a_ticker(work: Callable[[], Any], ticked: threading.Event) -> tuple[int, BaseException | None]:
    """Awaits `work()` while a 1 ms timer sets `ticked` on every run; the loop's thread, and what `work` raised."""
    async def tick() -> None:
        while True:
            ticked.set()
            await asyncio.sleep(0.001)

    ticker = asyncio.ensure_future(tick())
    try:
        await work()
        return threading.get_ident(), None
    except Exception as exc:
        return threading.get_ident(), exc
    finally:
        ticker.cancel()


def test_a_long_prompt_is_tokenized_off_the_event_loop(tokenizer: Any) -> None:
    """With the default model's 8192-token context a prompt may hold 663,552 characters: ~0.3 s of tokenizing,
    which used to hold the gateway's event loop (8 MiB of prompt held it 6 s). It runs on another thread, and the
    loop runs its timers meanwhile."""
    bound = max_prompt_chars(tokenizer, 8192)  # its one vocabulary scan done, as the gateway does at start-up
    prompt = ("hello world, " * (bound // 13))[:bound]
    request = GenerateInput(prompt=prompt)
    ticked = threading.Event()
    watched = WatchedTokenizer(tokenizer, ticked)
    loop_thread, raised = asyncio.run(_beside_a_ticker(lambda: parse_request(request, watched, VOCAB, 8192), ticked))
    assert isinstance(raised, InvalidRequest) and "tokens; the model's context is 8192" in str(raised)
    assert [what for what, _ in watched.calls] == [f"encode {len(prompt)} characters"]  # the prompt was tokenized
    assert all(thread != loop_thread for _, thread in watched.calls), "tokenized on the event loop's thread"
    assert watched.loop_ran == [True], "the event loop ran no timer while the prompt was being tokenized"


def test_what_cannot_fit_is_refused_before_it_is_tokenized(tokenizer: Any) -> None:
    bound = max_prompt_chars(tokenizer, CONTEXT)
    longest = max(map(len, tokenizer.get_vocab()))
    assert bound == CONTEXT * longest
    cases = {
        "prompt": GenerateInput(prompt="x" * (8 << 20)),
        "messages hold": GenerateInput(messages=[
            ChatTurn("user", "x" * (bound // 2 + 1)) for _ in range(2)]),
        "messages: 2049": GenerateInput(messages=[
            ChatTurn("user", "x")] * (MAX_MESSAGES + 1)),
        "prompt is 1000000 tokens": GenerateInput(token_ids=[1] * 1_000_000),
    }
    for says, request in cases.items():
        watched = WatchedTokenizer(tokenizer)
        with pytest.raises(InvalidRequest, match=says):
            asyncio.run(parse_request(request, watched, VOCAB, CONTEXT))
        assert watched.calls == [], says
    # at the bound, it is tokenized (and here refused for its tokens, not its characters)
    watched = WatchedTokenizer(tokenizer)
    with pytest.raises(InvalidRequest, match="tokens; the model's context is 512"):
        asyncio.run(parse_request(GenerateInput(prompt="y" * bound), watched, VOCAB, CONTEXT))
    assert [what for what, _ in watched.calls] == [f"encode {bound} characters"]


# --- clients -------------------------------------------------------------------------------------------------------

@dataclass
class Reply:
    status: int | str  # an HTTP status, or a gRPC status code's name ("OK" when the stream finished)
    message: str  # the error's message, and its `param` when it names one


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _read_reply(sock: socket.socket) -> Reply:
    """The status and error message of an HTTP response on `sock` (Connection: close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    try:
        error = json.loads(body)["error"]
        message = f"{error['message']} (param {error['param']})"
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")
    return Reply(status, message)


def post(cluster: Cluster, body: bytes | dict, path: str = "/v1/completions", headers: dict[str, str] | None = None,
         declared_length: int | None = None) -> Reply:
    """POST `body` (JSON-encoded if a dict) on a fresh connection; `declared_length` sends that Content-Length
    and only the body given."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    head = [f"POST {path} HTTP/1.1", "Host: pdserve", "Content-Type: application/json", "Connection: close",
            f"Content-Length: {len(raw) if declared_length is None else declared_length}",
            *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection(_host_port(cluster.gateway.http), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode("latin-1", "surrogateescape") + b"\r\n\r\n" + raw)
        return _read_reply(sock)


def post_chunked(cluster: Cluster, size: int) -> Reply:
    """A chunked body of `size` bytes, sent 64 KiB at a time for as long as the gateway reads it."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    with socket.create_connection(_host_port(cluster.gateway.http), timeout=10) as sock:
        sock.sendall(head)
        chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        try:
            for _ in range(size // 65536):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed before the whole body was sent
        return _read_reply(sock)


def slowloris(cluster: Cluster) -> Reply:
    """Headers, then a tenth of the body it announces, then nothing."""
    with socket.create_connection(_host_port(cluster.gateway.http), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\nConnection: close\r\n\r\n" + b'{"prompt": "' + b"a" * 88)
        return _read_reply(sock)


def abandoned_sse(cluster: Cluster) -> Reply:
    """A streaming completion left after its first event: the connection is closed, unread."""
    body = json.dumps({"prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(_host_port(cluster.gateway.http), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while b"data: " not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended before its first event: {data!r}"
            data += chunk
    return Reply(int(data.split(b" ", 2)[1]), "")


def grpc_call(cluster: Cluster, request: gateway_pb2.GenerateRequest | bytes, cancel_after: int = 0) -> Reply:
    """Generate with `request` (raw bytes are sent as they are), to its end or, with `cancel_after`, cancelled
    after that many responses."""
    with grpc.insecure_channel(cluster.gateway.address) as channel:
        if isinstance(request, bytes):
            call = channel.unary_stream("/pdserve.v1.Gateway/Generate",
                                        response_deserializer=gateway_pb2.GenerateResponse.FromString)(request,
                                                                                                       timeout=10)
        else:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=10)
        try:
            for n, _ in enumerate(call, start=1):
                if n == cancel_after:
                    call.cancel()
                    return Reply("CANCELLED", "")
        except grpc.RpcError as exc:
            return Reply(exc.code().name, exc.details() or "")  # type: ignore[attr-defined]
        return Reply("OK", "")


def grpc_cancel(cluster: Cluster, request: gateway_pb2.CancelRequest | bytes) -> Reply:
    with grpc.insecure_channel(cluster.gateway.address) as channel:
        call = channel.unary_unary("/pdserve.v1.Gateway/Cancel",
                                   request_serializer=None if isinstance(request, bytes) else
                                   gateway_pb2.CancelRequest.SerializeToString,
                                   response_deserializer=gateway_pb2.CancelResponse.FromString)
        try:
            call(request, timeout=10)
        except grpc.RpcError as exc:
            return Reply(exc.code().name, exc.details() or "")  # type: ignore[attr-defined]
        return Reply("OK", "")


def _wire(**fields: bytes | int) -> bytes:
    """A GenerateRequest written by hand: field number -> bytes (length-delimited) or int (varint)."""
    numbers = {"prompt": 1, "max_tokens": 3, "stop": 7, "request_id": 8, "unknown": 99}
    out = b""
    for name, value in fields.items():
        number = numbers[name.rstrip("_")]
        out += varint_field(number, value) if isinstance(value, int) else field(number, 2, value)
    return out


# --- the corpus ----------------------------------------------------------------------------------------------------

@dataclass
class Entry:
    name: str
    send: Callable[[Cluster], Reply]
    expect: int | str  # HTTP status or gRPC status name
    says: str = ""  # in the error message: the field or the limit named

    @property
    def served(self) -> bool:
        """A request the gateway accepts (and serves, or has served until its client left)."""
        return self.expect in (200, "OK", "CANCELLED")


def _chat(messages: Any, **extra: Any) -> Callable[[Cluster], Reply]:
    return lambda c: post(c, {"messages": messages, "max_tokens": 2, **extra}, "/v1/chat/completions")


def _completion(**body: Any) -> Callable[[Cluster], Reply]:
    return lambda c: post(c, {"max_tokens": 2, **body})


def _generate(**fields: Any) -> Callable[[Cluster], Reply]:
    return lambda c: grpc_call(c, gateway_pb2.GenerateRequest(**fields))


USER = {"role": "user", "content": "Hi"}
HI = {"prompt": "Hi"}

CORPUS = [
    # sizes: refused by what they declare or hold, before the work they would cost
    Entry("body over the cap, by Content-Length", lambda c: post(c, b"{", declared_length=8 << 20), 413, "bytes"),
    Entry("chunked body over the cap", lambda c: post_chunked(c, MAX_BODY_BYTES + (256 << 10)), 413, "bytes"),
    Entry("prompt of 900,000 characters", _completion(prompt="x" * 900_000), 400, "characters"),
    Entry("prompt within the characters, past the context", _completion(prompt="ab " * 13_000), 400, "tokens"),
    Entry("2,049 messages", _chat([USER] * (MAX_MESSAGES + 1)), 400, "2048"),
    Entry("2,048 messages, past the context", _chat([USER] * MAX_MESSAGES), 400, "tokens"),
    Entry("messages' content past any context", _chat([{"role": "user", "content": "x" * 30_000}] * 2), 400,
          "characters of content"),
    Entry("600 token ids for a 512-token context", _completion(prompt=list(range(600))), 400, "600 tokens"),
    Entry("gRPC prompt of 3.9 MB", _generate(prompt="x" * 3_900_000), "INVALID_ARGUMENT", "characters"),
    # grpc refuses it, not pdserve
    Entry("gRPC message over 8 MiB", _generate(prompt="x" * (MAX_MESSAGE_BYTES + 1)), "RESOURCE_EXHAUSTED"),
    Entry("gRPC 2,049 messages", _generate(messages=[gateway_pb2.ChatMessage(role="user", content="x")] * 2049),
          "INVALID_ARGUMENT", "2048"),
    Entry("gRPC 800,000 token ids", _generate(token_ids=[7] * 800_000), "INVALID_ARGUMENT", "800000 tokens"),
    # JSON itself
    Entry("JSON nested 100,000 deep", lambda c: post(c, b"[" * 100_000), 400, "nests too deeply"),
    Entry("chat content nested 500 deep", lambda c: post(
        c, b'{"messages": [{"role": "user", "content": ' + b"[" * 500 + b"]" * 500 + b"}]}", "/v1/chat/completions"),
        400, "messages[0].content"),
    Entry("invalid UTF-8 in the body", lambda c: post(c, b'{"prompt": "\xff\xfe"}'), 400, "UTF-8"),
    Entry("a lone surrogate in the prompt", lambda c: post(c, b'{"prompt": "\\ud800"}'), 400, "prompt"),
    Entry("a lone surrogate in a message", _chat([{"role": "user", "content": "\ud800"}]), 400, "content"),
    Entry("a repeated key", lambda c: post(c, b'{"prompt": "Hi", "max_tokens": 2, "max_tokens": 99}'), 400,
          "max_tokens"),
    Entry("NaN, which is not JSON", lambda c: post(c, b'{"prompt": "Hi", "temperature": NaN}'), 400, "NaN"),
    Entry("an empty body", lambda c: post(c, b""), 400, "JSON"),
    Entry("a body that is a list", lambda c: post(c, b"[1, 2]"), 400, "JSON object"),
    Entry("unknown fields are ignored, as vLLM does", _completion(**HI, frobnicate=True, store=1), 200),
    # wrong types and out-of-range values
    Entry("max_tokens as a string", _completion(**HI, max_tokens="10"), 400, "max_tokens"),
    Entry("max_tokens 2**40", _completion(**HI, max_tokens=2**40), 400, "max_tokens"),
    Entry("temperature as a string", _completion(**HI, temperature="hot"), 400, "temperature"),
    Entry("temperature 1e400 (infinity)", lambda c: post(c, b'{"prompt": "Hi", "temperature": 1e400}'), 400,
          "temperature"),
    Entry("temperature a negative denormal", _completion(**HI, temperature=-5e-324), 400, "temperature"),
    Entry("temperature a denormal: greedy", _completion(**HI, temperature=5e-324), 200),
    Entry("top_p 1e-50, zero as a float32", _completion(**HI, top_p=1e-50), 400, "top_p"),
    Entry("top_k 2**40", _completion(**HI, top_k=2**40), 400, "top_k"),
    Entry("seed -1", _completion(**HI, seed=-1), 400, "seed"),
    Entry("n true", _completion(**HI, n=True), 400, "n"),
    Entry("token ids out of the vocabulary", _completion(prompt=[1, VOCAB]), 400, "outside the vocabulary"),
    Entry("token ids negative", _completion(prompt=[1, -1]), 400, "prompt"),
    Entry("token ids as booleans", _completion(prompt=[True, False]), 400, "prompt"),
    Entry("role not a string", _chat([{"role": 5, "content": "Hi"}]), 400, "messages[0]"),
    Entry("role unknown", _chat([{"role": "robot", "content": "Hi"}]), 400, "role"),
    Entry("17 stop strings", _completion(**HI, stop=["a"] * 17), 400, "stop"),
    Entry("stream as a string", _completion(**HI, stream="yes"), 400, "stream"),
    Entry("model as a number", _completion(**HI, model=5), 400, "model"),
    Entry("an unknown model", _completion(**HI, model="gpt-5"), 404, "gpt-5"),
    Entry("X-Request-Id of 200 characters", lambda c: post(c, {**HI, "max_tokens": 2},
                                                           headers={"X-Request-Id": "r" * 200}), 400, "request_id"),
    Entry("X-Request-Id with invalid UTF-8", lambda c: post(c, {**HI, "max_tokens": 2},
                                                            headers={"X-Request-Id": "r\udcff"}), 400, "X-Request-Id"),
    Entry("GET on a POST route", lambda c: _get(c, "/v1/completions"), 405),
    Entry("gRPC temperature NaN", _generate(prompt="Hi", temperature=float("nan")), "INVALID_ARGUMENT",
          "temperature"),
    Entry("gRPC temperature a negative denormal", _generate(prompt="Hi", temperature=-1e-45), "INVALID_ARGUMENT",
          "temperature"),
    Entry("gRPC top_p a denormal: the top token", _generate(prompt="Hi", top_p=1e-45, max_tokens=2), "OK"),
    Entry("gRPC top_k 2**32-1: no cut", _generate(prompt="Hi", top_k=2**32 - 1, max_tokens=2), "OK"),
    Entry("gRPC max_tokens 2**32-1", _generate(prompt="Hi", max_tokens=2**32 - 1), "INVALID_ARGUMENT",
          "max_tokens"),
    Entry("gRPC token id past the vocabulary", _generate(token_ids=[1, 2**32 - 1]), "INVALID_ARGUMENT",
          "token_ids[1]"),
    Entry("gRPC request_id with a newline", _generate(prompt="Hi", request_id="a\nb"), "INVALID_ARGUMENT",
          "request_id"),
    Entry("gRPC prompt and messages both", _generate(prompt="Hi", messages=[gateway_pb2.ChatMessage(
        role="user", content="Hi")]), "INVALID_ARGUMENT", "prompt and messages"),
    Entry("gRPC invalid UTF-8 in the prompt", lambda c: grpc_call(c, _wire(prompt=b"\xff\xfe")),
          "INVALID_ARGUMENT", "UTF-8"),
    Entry("gRPC invalid UTF-8 in a stop string", lambda c: grpc_call(c, _wire(prompt=b"Hi", stop=b"\xc3")),
          "INVALID_ARGUMENT", "UTF-8"),
    Entry("gRPC bytes that are no message", lambda c: grpc_call(c, b"\xff\xff\xff\xff"), "INVALID_ARGUMENT"),
    Entry("gRPC an unknown field: ignored, as protobuf does", lambda c: grpc_call(
        c, _wire(prompt=b"Hi", max_tokens=2, unknown=b"x")), "OK"),
    Entry("gRPC a repeated field: the last wins, as protobuf says",
          lambda c: grpc_call(c, _wire(prompt=b"x" * 100_000, prompt_=b"Hi", max_tokens=2)), "OK"),
    Entry("gRPC Cancel with no id", lambda c: grpc_cancel(c, gateway_pb2.CancelRequest()), "INVALID_ARGUMENT",
          "request_id"),
    Entry("gRPC Cancel with invalid UTF-8", lambda c: grpc_cancel(c, b"\x0a\x01\xff"), "INVALID_ARGUMENT"),
    # slow and abandoned clients: a status, and nothing held after
    Entry("slowloris body", slowloris, 408, "did not arrive"),
    Entry("abandoned SSE stream", abandoned_sse, 200),
    Entry("abandoned gRPC stream", lambda c: grpc_call(c, gateway_pb2.GenerateRequest(
        prompt="Tell me a story", max_tokens=400, ignore_eos=True), cancel_after=2), "CANCELLED"),
]


def _get(cluster: Cluster, path: str) -> Reply:
    with socket.create_connection(_host_port(cluster.gateway.http), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: pdserve\r\nConnection: close\r\n\r\n".encode())
        return _read_reply(sock)


class Bystander:
    """Greedy streams of 200 tokens back to back in a process of its own (the senders' work does not delay its
    reads), from its first response until stopped, at most `streams`: the tokens each stream got."""

    TOKENS = 200

    def __init__(self, cluster: Cluster, streams: int = 30) -> None:
        self.tokens: list[int] = []  # per finished stream
        self._args = [sys.executable, "-c", _BYSTANDER, cluster.gateway.address, str(streams), str(self.TOKENS)]

    def __enter__(self) -> Bystander:
        self._process = subprocess.Popen(self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         cwd=Path(__file__).parent.parent)
        assert self._process.stdout is not None and self._process.stdout.readline() == "streaming\n"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._process.communicate("stop\n", timeout=120)
        assert self._process.returncode == 0  # a stream that failed raised there
        self.tokens = json.loads(out)

    @property
    def finished(self) -> int:
        return len(self.tokens)


# The bystander process (no torch: it starts fast): says "streaming" at its first response, streams until a line
# arrives on stdin (looked for between streams), then prints the tokens each stream got.
_BYSTANDER = """
import json, select, sys
from pdserve.client import stream
tokens = []
for n in range(int(sys.argv[2])):
    got = []
    for response in stream(sys.argv[1], 120, prompt="Tell me a story", max_tokens=int(sys.argv[3]), ignore_eos=True,
                           temperature=0, request_id=f"bystander-{n}"):
        if not got and n == 0:
            print("streaming", flush=True)
        got += response.token_ids
    tokens.append(len(got))
    if select.select([sys.stdin], [], [], 0)[0]:
        break
print(json.dumps(tokens))
"""


def _accepted(cluster: Cluster) -> float:
    """Requests the gateway accepted (valid, not a duplicate id), all time."""
    return scrape(cluster.gateway.metrics)["pdserve_requests_total"]


BIG = [  # what used to run on the gateway's event loop before any size check (issue 21 item 5)
    Entry("a prompt just under the body cap", _completion(prompt="x" * (MAX_BODY_BYTES - 100)), 400, "characters"),
    Entry("a 3.9 MB gRPC prompt", _generate(prompt="x" * 3_900_000), "INVALID_ARGUMENT", "characters"),
    Entry("an 8 MiB body", lambda c: post(c, b"{", declared_length=8 << 20), 413, "bytes"),
    Entry("2,049 messages", _chat([USER] * (MAX_MESSAGES + 1)), 400, "2048"),
    Entry("2,048 messages, rendered and tokenized", _chat([USER] * MAX_MESSAGES), 400, "tokens"),
    Entry("a prompt at the character bound, tokenized", _completion(prompt="ab " * 13_800), 400, "tokens"),
]


@pytest.mark.timeout(300)
def test_big_requests_are_refused_unaccepted_while_a_bystander_gets_every_token(hostile: Cluster) -> None:
    accepted = _accepted(hostile)
    with Bystander(hostile) as bystander:
        replies = [(entry, entry.send(hostile)) for _ in range(3) for entry in BIG]
    wrong = [(entry.name, reply) for entry, reply in replies
             if reply.status != entry.expect or entry.says not in reply.message]
    assert not wrong, wrong
    assert _accepted(hostile) - accepted == bystander.finished  # the bystander's streams, and no big request
    assert bystander.tokens and bystander.tokens == [Bystander.TOKENS] * bystander.finished
    assert_nothing_live(hostile, within_s=10)


@pytest.mark.timeout(300)
def test_the_hostile_corpus_gets_precise_statuses_and_leaves_nothing_held(hostile: Cluster) -> None:
    assert len({entry.name for entry in CORPUS}) == len(CORPUS) >= 30
    # 1. the corpus, with the bystander streaming beside it
    accepted = _accepted(hostile)
    replies: dict[str, Reply] = {}
    with Bystander(hostile) as bystander:
        for entry in CORPUS:
            replies[entry.name] = entry.send(hostile)
    # 2. every status as expected; only the requests served were accepted (with the bystander's)
    wrong = {entry.name: replies[entry.name] for entry in CORPUS
             if replies[entry.name].status != entry.expect or entry.says not in replies[entry.name].message}
    assert not wrong, wrong
    served = sum(entry.served for entry in CORPUS)
    assert _accepted(hostile) - accepted == served + bystander.finished
    # 3. the bystander finished every stream it started, each with all its tokens
    assert bystander.tokens and bystander.tokens == [Bystander.TOKENS] * bystander.finished
    # 4. leak check
    assert_nothing_live(hostile, within_s=10)
    assert_nothing_held(hostile)
