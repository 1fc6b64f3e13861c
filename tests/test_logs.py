"""Service logging, in real processes: a stderr nobody reads never blocks the event loop; lines keep their request
and trace ids, exceptions and format; lines logged just before exit are written."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import IO

import pytest

from serving import logs

ROOT = Path(__file__).resolve().parents[1]
WAIT_SECONDS = 60.0  # for what takes a second or two: generous on a busy machine


def _spawn(script: str, log_format: str = "text") -> subprocess.Popen[str]:
    env = {**os.environ, logs.LOG_FORMAT_ENV: log_format, "PDSERVE_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lines(stream: IO[str]) -> queue.Queue[str]:
    """The stream's lines as they come, read by a thread ("" at the end)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def _next(lines: queue.Queue[str], what: str) -> str:
    try:
        return lines.get(timeout=WAIT_SECONDS)
    except queue.Empty:
        pytest.fail(f"no {what} within {WAIT_SECONDS:.0f} s")


def _drain(lines: queue.Queue[str]) -> list[str]:
    got = []
    while line := _next(lines, "end of stderr"):
        got.append(line.rstrip("\n"))
    return got


FLOOD = """
    import asyncio, json, logging, sys
    from serving import logs

    logs.configure()
    log = logging.getLogger("flood")

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        for i in range(20_000):  # 4 MB: far past the pipe's 64 KiB and the queue
            log.info("flood %d %s", i, "x" * 200)
            if i % 500 == 0:
                await asyncio.sleep(0)
        before = ticks
        for i in range(50):  # half a second of logging while the queue is full: the timer keeps ticking
            log.info("still logging %d", i)
            await asyncio.sleep(0.01)
        print(json.dumps({"ticks": ticks - before, "dropped": logs.dropped_records()}), flush=True)
        sys.stdin.readline()  # the test reads stderr from now on
        for i in range(1000):  # until a line is queued again: with the notice of the lines dropped
            dropped = logs.dropped_records()
            log.info("resumed %d", i)
            if logs.dropped_records() == dropped:
                break
            await asyncio.sleep(0.01)
        ticker.cancel()
        print(json.dumps({"dropped": logs.dropped_records()}), flush=True)

    asyncio.run(main())
"""


def test_a_stderr_nobody_reads_never_blocks_the_event_loop() -> None:
    """1. A process logs 4 MB from its event loop into a stderr pipe that is not read: the loop keeps running and
    lines are dropped and counted. (Logging used to write to stderr in the caller: the loop froze on a full pipe.)
    2. Once stderr is read again, the queued lines come out, then one line saying how many were dropped.
    3. The process exits."""
    proc = _spawn(FLOOD)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        report = _lines(proc.stdout)
        flooded = json.loads(_next(report, "report from a process logging into a full stderr pipe"))
        assert flooded["ticks"] >= 5, "the event loop stalled"
        assert flooded["dropped"] > 0
        stderr = _lines(proc.stderr)  # 2
        proc.stdin.write("read\n")
        proc.stdin.flush()
        dropped = json.loads(_next(report, "final report"))["dropped"]
        assert proc.wait(timeout=WAIT_SECONDS) == 0  # 3
        lines = _drain(stderr)
    finally:
        proc.kill()
        proc.wait()
    notices = [int(match[1]) for line in lines if (match := re.search(r"(\d+) log lines dropped", line))]
    assert notices and sum(notices) == dropped >= flooded["dropped"]
    flood = [int(line.split("flood ")[1].split()[0]) for line in lines if " flood: flood " in line]
    assert flood == list(range(len(flood))) and len(flood) > 1000, "the lines before the drops, in order"
    notice_at = next(i for i, line in enumerate(lines) if "log lines dropped" in line)
    assert any("resumed" in line for line in lines[notice_at:])


def test_a_process_exits_though_its_stderr_is_never_read() -> None:
    """At exit the queued lines get a couple of seconds to be written, not forever: a stuck stderr cannot keep a
    stopped service alive."""
    proc = _spawn("""
        import logging
        from serving import logs

        logs.configure()
        for i in range(20_000):
            logging.getLogger("flood").info("flood %d %s", i, "x" * 200)
    """)
    try:
        assert proc.wait(timeout=WAIT_SECONDS) == 0
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {WAIT_SECONDS:.0f} s after its last line, blocked on stderr")
    finally:
        proc.kill()
        proc.wait()


IDS = """
    import asyncio, json, logging
    from opentelemetry.sdk.trace import TracerProvider
    from serving import logs

    logs.configure()
    log = logging.getLogger("ids")
    tracer = TracerProvider().get_tracer("test")

    async def handle():
        logs.for_request("req-7")
        with tracer.start_as_current_span("handle") as span:
            ids = span.get_span_context()
            print(json.dumps({"trace_id": f"{ids.trace_id:032x}", "span_id": f"{ids.span_id:016x}"}), flush=True)
            log.info("inside the span")
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("it failed")
        # the span has ended: the ids were taken when the line was logged, not when it is written

    asyncio.run(handle())
    log.info("no request")
    for i in range(2000):  # the last thing the process does: all written at exit
        log.info("last %d", i)
"""


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_lines_carry_request_and_trace_ids_and_the_last_lines_are_written(log_format: str) -> None:
    proc = _spawn(IDS, log_format)
    out, err = proc.communicate(timeout=WAIT_SECONDS)
    assert proc.returncode == 0, err
    ids = json.loads(out.splitlines()[0])
    lines = err.splitlines()
    if log_format == "json":
        records = [json.loads(line) for line in lines if line.startswith("{")]
        inside = next(r for r in records if r["message"] == "inside the span")
        assert (inside["request_id"], inside["trace_id"], inside["span_id"]) == (
            "req-7", ids["trace_id"], ids["span_id"])
        failed = next(r for r in records if r["message"] == "it failed")
        assert failed["trace_id"] == ids["trace_id"] and "ValueError: boom" in failed["exception"]
        assert "request_id" not in next(r for r in records if r["message"] == "no request")
        last = [r["message"] for r in records if r["message"].startswith("last ")]
    else:
        assert any(line.endswith("INFO ids: [req-7] inside the span") for line in lines)
        failed = next(i for i, line in enumerate(lines) if line.endswith("ERROR ids: [req-7] it failed"))
        assert "Traceback" in lines[failed + 1] and "ValueError: boom" in lines
        assert any(line.endswith("INFO ids: no request") for line in lines)
        last = [line.split(": ", 1)[1] for line in lines if ": last " in line]
    assert last == [f"last {i}" for i in range(2000)]


_BAD_METADATA = r"""
import asyncio, socket, struct, sys, grpc
from serving import logs
from protos import gateway_pb2, gateway_pb2_grpc
logs.configure()

class Refuse(gateway_pb2_grpc.GatewayServicer):
    async def Generate(self, request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong key")

def send(port):  # HTTP/2 by hand: grpcio's clients refuse to send metadata that is not UTF-8
    sock = socket.create_connection(("127.0.0.1", port))
    def frame(kind, flags, stream, payload):
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload
    def literal(name, value):
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
    headers = b"".join(literal(n, v) for n, v in [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/pdserve.v1.Gateway/Generate"),
        (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        (b"authorization", b"Bearer \xff\xfeNEARMISSKEY")])
    body = gateway_pb2.GenerateRequest(prompt="x").SerializeToString()
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, headers)
                 + frame(0, 1, 1, b"\x00" + struct.pack(">I", len(body)) + body))
    sock.settimeout(30)
    data = b""
    while True:  # the frames until the stream's trailers (HEADERS with END_STREAM): the call is over
        while len(data) < 9:
            data += sock.recv(65536) or sys.exit("connection closed before the status")
        size, kind, flags, stream = int.from_bytes(data[:3], "big"), data[3], data[4], data[5:9]
        while len(data) < 9 + size:
            data += sock.recv(65536) or sys.exit("connection closed mid-frame")
        data = data[9 + size:]
        if kind == 1 and flags & 1 and int.from_bytes(stream, "big") == 1:
            break
    sock.close()

async def main():
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(Refuse(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await asyncio.to_thread(send, port)
    await server.stop(5)  # the call is over: nothing in flight for the loop's exit to cancel (grpcio prints that)
    logs.logging.getLogger("check").info("done")

asyncio.run(main())
"""


def test_grpc_metadata_that_is_not_utf8_is_never_logged() -> None:
    """grpcio logs an undecodable metadata value whole, with a traceback: for a mistyped authorization header, a
    near-miss API key. The services' logging drops that record."""
    process = _spawn(_BAD_METADATA)
    out, err = process.communicate(timeout=WAIT_SECONDS)
    assert process.returncode == 0, err
    assert "check: done" in err  # the process logged, and its last line was written
    assert "NEARMISSKEY" not in err and "Invalid encoding" not in err and "Traceback" not in err


_LONG_HEADER = r"""
import asyncio
from aiohttp import web
from serving import logs
logs.configure()

async def main():
    app = web.Application()
    app.router.add_get("/", lambda request: web.Response(text="hi"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer NEARMISSKEY" + b"k" * 9000 + b"\r\n\r\n")
    print((await reader.readline()).decode().strip(), flush=True)
    writer.close()
    await runner.cleanup()
    logs.logging.getLogger("check").info("done")

asyncio.run(main())
"""


def test_an_http_header_past_the_parser_limit_is_refused_and_never_logged() -> None:
    """aiohttp logs a header line past its limit at ERROR, quoting the line's start: for an Authorization header,
    the start of a key. The services log one warning instead, and the client still gets its 400."""
    process = _spawn(_LONG_HEADER)
    out, err = process.communicate(timeout=WAIT_SECONDS)
    assert process.returncode == 0, err
    assert out.startswith("HTTP/1.") and " 400 " in out
    assert "check: done" in err and "refused a malformed HTTP request from 127.0.0.1 (LineTooLong)" in err
    assert "NEARMISSKEY" not in err and "Traceback" not in err and "ERROR" not in err
