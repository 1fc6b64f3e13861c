"""An SSE stream whose client never reads, with the kernel's default buffers, is cut: the gateway's HTTP edge
(OpenAIServer, real aiohttp on a loopback socket) over a core that streams one token every 30 ms, as a decode
worker at a CPU's pace does. Linux keeps taking small writes for a socket that never reads (it grows the receive
buffer instead of closing the window), so the edge pads each event to --sse-min-write-bytes with spaces after its
JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from gateway.auth import ApiKeys
from gateway.messages import Delta, Timing, Usage
from gateway.openai_api import DEFAULT_SSE_MIN_WRITE_BYTES, OpenAIServer, padded

TOKEN_S = 0.03  # a decode step's pace on a CPU: slow enough that the kernel keeps growing a small-write buffer


class PacedCore:
    """The part of the gateway's core the HTTP edge calls: a stream of one-character tokens, TOKEN_S apart, that
    notes when it was closed (the request cut, its place freed)."""

    def __init__(self, tokens: int) -> None:
        self.keys, self.model, self.tokens = ApiKeys(), SimpleNamespace(max_model_len=8192), tokens
        self.metrics = self  # the edge counts the stalls it cuts here
        self.counted: list[str] = []
        self.closed_at: float | None = None
        self.closed = asyncio.Event()

    def count(self, name: str, amount: float = 1, **labels: str) -> None:
        self.counted.append(name)

    async def stream(self, request: Any, deadline: float | None, metadata: Any = None,
                     peer: str = "") -> AsyncIterator[Delta]:
        try:
            for _ in range(self.tokens - 1):
                yield Delta("r", [65], "A")
                await asyncio.sleep(TOKEN_S)
            yield Delta("r", [65], "A", "length", Usage(1, self.tokens), Timing())
        finally:
            self.closed_at = time.monotonic()
            self.closed.set()


def _never_reading_stream(address: str) -> socket.socket:
    """A streaming completion from a client that never reads: the system's socket buffers, as an attacker's."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    body = json.dumps({"prompt": "x", "max_tokens": 4000, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_a_never_reading_sse_client_with_default_buffers_is_cut_while_its_socket_is_open() -> None:
    """4000 tokens at 30 ms would take 2 minutes; the client, which never reads, is cut within the first minute
    (its buffers hold ~250 KB of padded events, the stall timeout 1 s), its socket still open. Without the padding
    (--sse-min-write-bytes 0) the same client was taken for the whole minute: never cut."""

    async def scenario() -> tuple[float | None, int]:
        core = PacedCore(4000)
        edge = OpenAIServer(core, "m", stall_timeout_s=1.0, sse_min_write_bytes=DEFAULT_SSE_MIN_WRITE_BYTES)  # type: ignore[arg-type]
        address = await edge.start("127.0.0.1", 0)
        sock = await asyncio.to_thread(_never_reading_stream, address)
        began = time.monotonic()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(core.closed.wait(), 60)
            return (None if core.closed_at is None else core.closed_at - began), core.counted.count(
                "pdserve_client_stalls")
        finally:
            sock.close()
            await edge.stop()

    cut_after, stalls = asyncio.run(scenario())
    assert cut_after is not None, "the client that never reads was not cut within a minute"
    assert stalls == 1


def _as_vllm_bench_serve_reads(reads: list[bytes]) -> list[dict]:
    """The events a client gets that strips each network read of surrounding whitespace, then splits what it has
    buffered at blank lines and skips comments (`:`), taking a buffered `data:` line whose JSON parses as an event
    too: vLLM's `vllm bench serve` (its StreamedResponseHandler), reading one write at a time."""
    buffer, events = "", []
    for read in reads:
        buffer += read.strip().decode()
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            if message.strip() and not message.strip().startswith(":"):
                events.append(json.loads(message.strip().removeprefix("data: ")))
        if buffer.startswith("data: "):
            try:
                events.append(json.loads(buffer.removeprefix("data: ")))
                buffer = ""
            except json.JSONDecodeError:
                pass
    return events


def test_each_event_is_padded_inside_its_own_data_line_and_every_client_gets_it_whole() -> None:
    event = b'data: {"a":1}\n\n'
    write = padded(event, 1024)
    assert len(write) == 1024 and write.startswith(event[:-2]) and write.endswith(b"\n\n")
    assert write.count(b"\n") == 2 and json.loads(write.removeprefix(b"data: ")) == {"a": 1}  # one event, its JSON
    assert padded(event, 0) == event and padded(b"x" * 2000, 1024) == b"x" * 2000
    writes = [padded(b'data: {"i":%d}\n\n' % i, 1024) for i in range(6)]
    # a stripping reader, one write per read (a comment block after each event lost every other one), and a plain
    # SSE reader that splits the whole stream at blank lines
    assert _as_vllm_bench_serve_reads(writes) == [{"i": i} for i in range(6)]
    blocks = [block for block in b"".join(writes).split(b"\n\n") if block]
    assert [json.loads(block.removeprefix(b"data: ")) for block in blocks] == [{"i": i} for i in range(6)]
