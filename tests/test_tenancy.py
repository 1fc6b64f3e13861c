"""Sharing the gateway: a client that stops reading is cut and frees what it held while its socket is still open;
one client (an API key, or a peer address) holds at most its share of the places, and a freed place goes to the
client running fewest. Real clusters on loopback, real sockets that never read."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway import admission as admission_module
from gateway.admission import Admission, AdmissionConfig, Overloaded
from gateway.messages import GenerateInput
from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import gateway_pb2, gateway_pb2_grpc
from serving.metrics import scrape
from tests.helpers import assert_nothing_held, live_gauges, start_cluster, wait_until

STALL_S = 1.0


@pytest.fixture(scope="module")
def stall_cluster(long_tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = start_cluster(long_tiny_model_dir, gateway_args=(f"--client-stall-timeout={STALL_S}",
                                                          "--max-in-flight-per-client=3", "--max-queue-per-client=1"))
    try:
        yield cluster
    finally:
        cluster.stop()


def _metric(cluster: Cluster, name: str) -> float:
    return scrape(cluster.gateway.metrics).get(name, 0.0)


def _stuck_sse(http: str, max_tokens: int) -> socket.socket:
    """A streaming completion whose client never reads a byte: a receive buffer of 1 KB, so the gateway's writes
    wait after a few kB of the stream."""
    host, port = http.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed the connection (reading drains what it had sent first)."""
    sock.settimeout(0.5)
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_sse_readers_that_never_read_are_cut_and_free_everything_while_their_sockets_stay_open(
        stall_cluster: Cluster) -> None:
    """1. Two streams whose clients never read, each asking for the whole context. 2. A bystander is served beside
    them. 3. Both are cut (pdserve_client_stalls) while their sockets are open, and every gauge and worker returns
    to zero. 4. The gateway closed their connections."""
    stalls = _metric(stall_cluster, "pdserve_client_stalls_total")
    stuck = [_stuck_sse(stall_cluster.gateway.http, 8000) for _ in range(2)]  # ~1.6 MB of events each
    try:
        beside = generate(stall_cluster.gateway.address, timeout=60, prompt="Hi", max_tokens=4, temperature=0)
        assert beside.finish_reason == "length" and len(beside.token_ids) == 4
        wait_until(lambda: _metric(stall_cluster, "pdserve_client_stalls_total") >= stalls + 2,
                   "both stuck readers cut", timeout_s=120)
        wait_until(lambda: not any(live_gauges(stall_cluster).values()), lambda: f"gauges {live_gauges(stall_cluster)}",
                   timeout_s=30)
        assert_nothing_held(stall_cluster, within_s=10)
        assert all(_closed_by_peer(sock) for sock in stuck)
    finally:
        for sock in stuck:
            sock.close()


# A gRPC client that never reads: HTTP/2 by hand, announcing a stream window of 1 byte (SETTINGS_INITIAL_WINDOW_SIZE),
# so the gateway's first response waits for a WINDOW_UPDATE that never comes. Runs as its own process: it keeps its
# socket open until killed.
_RAW_GRPC_CLIENT = r"""
import socket, struct, sys, time
from protos import gateway_pb2
host, port = sys.argv[1].rsplit(":", 1)
sock = socket.create_connection((host, int(port)))
def frame(kind, flags, stream, payload):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload
settings = struct.pack(">HI", 0x4, 1)  # SETTINGS_INITIAL_WINDOW_SIZE = 1
def literal(name, value):  # HPACK literal header field without indexing, new name
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
headers = b"".join(literal(n, v) for n, v in [
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/pdserve.v1.Gateway/Generate"),
    (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
request = gateway_pb2.GenerateRequest(prompt="Once upon a time", max_tokens=64, ignore_eos=True).SerializeToString()
message = b"\x00" + struct.pack(">I", len(request)) + request
sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, settings) + frame(1, 4, 1, headers)
             + frame(0, 1, 1, message))
print("sent", flush=True)
if sys.stdin.readline().strip() != "resume":  # until told: never read the socket
    sys.exit()
# Read again: open both windows wide, then read frames until stream 1 ends (ACKing the gateway's pings meanwhile).
sock.sendall(frame(8, 0, 0, struct.pack(">I", 1 << 30)) + frame(8, 0, 1, struct.pack(">I", 1 << 30)))
sock.settimeout(30)
deadline = time.monotonic() + 30  # the status follows at once (a gateway that cancelled the write sent it ~60 s late)
def exactly(n):
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise EOFError
        data += more
    return data
try:
    while True:
        head = exactly(9)
        length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
        stream = struct.unpack(">I", head[5:])[0] & 0x7FFFFFFF
        payload = exactly(length)
        if kind == 6 and not flags & 1:
            sock.sendall(frame(6, 1, 0, payload))
        if stream == 1 and kind == 3:
            print("reset", flush=True); break
        if stream == 1 and kind == 1 and flags & 1:
            print("trailers" if time.monotonic() < deadline else "late trailers", payload.hex(), flush=True); break
except (EOFError, OSError):
    print("closed", flush=True)
"""


def test_a_grpc_stream_whose_window_never_opens_is_cut_and_frees_its_place(stall_cluster: Cluster) -> None:
    stalls = _metric(stall_cluster, "pdserve_client_stalls_total")
    root = Path(__file__).resolve().parents[1]
    client = subprocess.Popen([sys.executable, "-c", _RAW_GRPC_CLIENT, stall_cluster.gateway.address], cwd=root,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "sent"
        wait_until(lambda: _metric(stall_cluster, "pdserve_client_stalls_total") >= stalls + 1,
                   "the raw gRPC stream cut", timeout_s=60)
        assert client.poll() is None  # its socket is still open: the gateway freed the request under it
        wait_until(lambda: not any(live_gauges(stall_cluster).values()), lambda: f"gauges {live_gauges(stall_cluster)}",
                   timeout_s=30)
        assert_nothing_held(stall_cluster, within_s=10)
        assert generate(stall_cluster.gateway.address, timeout=60, prompt="Hi", max_tokens=2).finish_reason
    finally:
        client.kill()
        client.wait()


def test_a_grpc_client_that_reads_again_after_its_cut_gets_its_status(stall_cluster: Cluster) -> None:
    """Cut as stalled, the stream's place is freed at once; when the client reads again it gets the response that
    waited and then the call's status (trailers), never a call left open with no end."""
    stalls = _metric(stall_cluster, "pdserve_client_stalls_total")
    root = Path(__file__).resolve().parents[1]
    client = subprocess.Popen([sys.executable, "-c", _RAW_GRPC_CLIENT, stall_cluster.gateway.address], cwd=root,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdin is not None and client.stdout is not None
        assert client.stdout.readline().strip() == "sent"
        wait_until(lambda: _metric(stall_cluster, "pdserve_client_stalls_total") >= stalls + 1,
                   "the raw gRPC stream cut", timeout_s=60)
        wait_until(lambda: not any(live_gauges(stall_cluster).values()), lambda: f"gauges {live_gauges(stall_cluster)}",
                   timeout_s=30)
        client.stdin.write("resume\n")
        client.stdin.flush()
        ended, trailers = client.stdout.readline().rsplit(" ", 1)
        assert ended == "trailers"
        # grpc writes these trailers as literals: status 1 (CANCELLED), and the stall's message
        assert b"\x0bgrpc-status\x011" in bytes.fromhex(trailers) and b"read nothing" in bytes.fromhex(trailers)
    finally:
        client.kill()
        client.wait()


def test_one_client_over_its_caps_is_refused_at_once(stall_cluster: Cluster) -> None:
    """Without API keys a client is its peer address; here every call comes from 127.0.0.1, one client: three run,
    one waits, the fifth is refused at once with RESOURCE_EXHAUSTED and a retry hint. Over HTTP: 429 with
    Retry-After."""

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(stall_cluster.gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            long = gateway_pb2.GenerateRequest(prompt="Once upon a time", max_tokens=8000, ignore_eos=True)
            calls = [stub.Generate(long, timeout=120) for _ in range(3)]
            for call in calls:  # three run: each has its first token
                await call.read()
            calls.append(stub.Generate(long, timeout=120))  # the fourth waits
            for _ in range(600):
                if (await asyncio.to_thread(_metric, stall_cluster, "pdserve_queued_requests")) == 1:
                    break
                await asyncio.sleep(0.05)
            refused = stub.Generate(long, timeout=120)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await refused.read()
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queue-per-client" in (caught.value.details() or "")
            trailing = dict(await refused.trailing_metadata() or ())
            assert int(trailing["retry-after-ms"]) > 0
            import aiohttp
            async with aiohttp.ClientSession() as session, session.post(
                    f"http://{stall_cluster.gateway.http}/v1/completions",
                    json={"prompt": "Hi", "max_tokens": 2}) as response:
                assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
                assert (await response.json())["error"]["type"] == "rate_limit_error"
            for call in calls:
                call.cancel()

    asyncio.run(scenario())
    wait_until(lambda: not any(live_gauges(stall_cluster).values()), lambda: f"gauges {live_gauges(stall_cluster)}",
               timeout_s=30)
    assert_nothing_held(stall_cluster, within_s=10)


def test_a_freed_place_goes_to_the_client_running_fewest() -> None:
    """Two places. Client a holds both and queues two more; client b queues one after them. When one of a's ends,
    b gets the place (it runs none), not a's older waiter; then a's waiters in their order."""

    async def scenario() -> None:
        admission = Admission(AdmissionConfig(max_in_flight=2, max_queue=8, queue_timeout_s=30,
                                              max_in_flight_per_client=0, max_queue_per_client=0))
        order: list[str] = []
        release = {name: asyncio.Event() for name in ("a1", "a2", "a3", "a4", "b1")}

        async def request(name: str) -> None:
            async with admission.slot(client=name[0]):
                order.append(name)
                await release[name].wait()

        tasks = {}
        for name in ("a1", "a2", "a3", "a4", "b1"):
            tasks[name] = asyncio.ensure_future(request(name))
            await asyncio.sleep(0.01)
        assert order == ["a1", "a2"] and admission.queued == 3
        release["a1"].set()
        await asyncio.sleep(0.01)
        assert order[-1] == "b1"  # not a3, though a3 waited longer
        for name in ("a2", "b1", "a3", "a4"):
            release[name].set()
        await asyncio.gather(*tasks.values())
        assert order == ["a1", "a2", "b1", "a3", "a4"]
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_client_at_its_running_cap_waits_while_others_take_free_places() -> None:
    """Client a runs its one (its cap) and queues one: b takes a free place at once. a's queued request waits past
    the queue timeout while places are free (it waits on a's own request, as a request queues behind others on
    a server without tenants); once the places fill it is refused at its next queue timeout."""

    async def scenario() -> None:
        admission = Admission(AdmissionConfig(max_in_flight=4, max_queue=8, queue_timeout_s=0.3,
                                              max_in_flight_per_client=1, max_queue_per_client=1))
        hold = asyncio.Event()

        async def request(client: str) -> None:
            async with admission.slot(client=client):
                await hold.wait()

        first = asyncio.ensure_future(request("a"))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(request("a"))  # over a's running cap: waits though places are free
        await asyncio.sleep(0.01)
        assert (admission.running, admission.queued) == (1, 1)
        with pytest.raises(Overloaded, match="--max-queue-per-client"):
            await request("a")  # a's queue is full: refused at once
        other = asyncio.ensure_future(request("b"))  # b is under its cap: takes a free place at once
        await asyncio.sleep(0.01)
        assert (admission.running, admission.queued) == (2, 1)
        await asyncio.sleep(0.5)  # past the queue timeout: a's second waits on a's own first while places are free
        assert not second.done() and admission.queued == 1
        others = [asyncio.ensure_future(request(c)) for c in ("c", "d")]  # the places fill
        with pytest.raises(Overloaded, match="--max-in-flight-per-client"):
            await second  # now it waits on everyone: refused at its queue timeout
        hold.set()
        await asyncio.gather(first, other, *others)
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_client_refused_faster_than_its_instant_refusals_waits_for_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """Client a, at its caps, is refused 3 times at once (its instant refusals a second); its next refusals wait
    (the pause; one whose deadline is sooner only until shortly before it), while client b is still refused at
    once; and no more refusals wait than --max-queue, the rest are answered at once."""
    monkeypatch.setattr(admission_module, "REFUSAL_PAUSE_S", 60.0)  # longer than the test: no timing race

    async def scenario() -> None:
        admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=1, queue_timeout_s=30,
                                              max_in_flight_per_client=1, max_queue_per_client=1,
                                              instant_refusals_per_client=3))
        hold = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def request(client: str, deadline: float | None = None) -> None:
            async with admission.slot(deadline, client):
                await hold.wait()

        running = [asyncio.ensure_future(request("a")) for _ in range(2)]  # one runs, one queues
        await asyncio.sleep(0.01)
        assert (admission.running, admission.queued) == (1, 1)
        for _ in range(3):
            with pytest.raises(Overloaded, match="--max-queue-per-client") as refused:
                await request("a")
            assert not refused.value.paused
        soon = loop.time() + 0.2
        with pytest.raises(Overloaded) as refused:  # a's deadline is sooner than the pause: waits less
            await asyncio.wait_for(request("a", soon), 30)
        assert refused.value.paused and loop.time() < soon
        paused = asyncio.ensure_future(request("a"))
        await asyncio.sleep(0.05)
        assert not paused.done() and admission.pausing == 1
        with pytest.raises(Overloaded, match="gateway overloaded") as refused:  # b's first refusal: at once
            await request("b")
        assert not refused.value.paused and admission.queued == 1
        with pytest.raises(Overloaded) as refused:  # --max-queue (1) refusals wait already: at once
            await request("a")
        assert not refused.value.paused
        paused.cancel()
        await asyncio.gather(paused, return_exceptions=True)
        assert admission.pausing == 0
        hold.set()
        await asyncio.gather(*running)
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_with_no_queue_timeout_a_capped_request_is_refused_at_once() -> None:
    """--queue-timeout 0: a request over its client's running cap is refused at once, even with places free."""

    async def scenario() -> None:
        admission = Admission(AdmissionConfig(max_in_flight=4, max_queue=8, queue_timeout_s=0,
                                              max_in_flight_per_client=1, max_queue_per_client=4))
        hold = asyncio.Event()

        async def request() -> None:
            async with admission.slot(client="a"):
                await hold.wait()

        first = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="--max-in-flight-per-client"):
            await asyncio.wait_for(request(), 10)
        hold.set()
        await first
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_cut_call_still_open_counts_against_its_client_only() -> None:
    """A gRPC call cut as stalled stays open until its client reads or leaves. It holds none of the gateway's
    places, so others start at once; but it holds one of its own client's, so that client cannot pile up more
    such calls than its cap; when it ends, that client's waiter starts."""

    async def scenario() -> None:
        admission = Admission(AdmissionConfig(max_in_flight=2, max_queue=8, queue_timeout_s=30,
                                              max_in_flight_per_client=1, max_queue_per_client=4))
        with admission.holding("a"):
            assert admission.running == 0 and admission.held_by("a") == 1
            async with admission.slot(client="b"):  # a place of the gateway's: free
                pass
            slot = admission.slot(client="a")
            waiting = asyncio.ensure_future(slot.__aenter__())
            await asyncio.sleep(0.05)
            assert not waiting.done() and admission.queued == 1  # a is at its cap: its cut call holds it
        await asyncio.wait_for(waiting, 5)  # the cut call ended: a's request starts
        assert admission.running == 1 and admission.held_by("a") == 1
        await slot.__aexit__(None, None, None)
        assert admission.running == 0 and admission.held_by("a") == 0

    asyncio.run(scenario())


def test_http_connections_past_the_cap_are_answered_503_and_closed(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir, gateway_args=("--max-http-connections=2",))
    try:
        host, port = cluster.gateway.http.rsplit(":", 1)
        held = [socket.create_connection((host, int(port))) for _ in range(2)]
        wait_until(lambda: _answer(host, port).startswith(b"HTTP/1.1 503"), "the third connection refused")
        answer = _answer(host, port)
        assert b"Retry-After: 1" in answer and b"--max-http-connections" in answer
        held.pop().close()
        wait_until(lambda: _answer(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                   .startswith(b"HTTP/1.1 200"), "a connection served again once one closed")
        for sock in held:
            sock.close()
    finally:
        cluster.stop()


def _answer(host: str, port: str, request: bytes = b"") -> bytes:
    """What the gateway answers on a new connection (after sending `request`), until it closes it or 5 s pass."""
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(5)
        if request:
            sock.sendall(request)
        chunks = []
        try:
            while data := sock.recv(1 << 16):
                chunks.append(data)
        except TimeoutError:
            pass
        return b"".join(chunks)


def test_a_big_body_is_parsed_off_the_event_loop_and_hands_it_back() -> None:
    """A 1 MiB list of token ids (~30 ms to parse): parsed on a thread whose number hooks let the loop run, so a
    timer on the loop fires during the parse; and parsed exactly as json.loads parses it."""
    from gateway import openai_api, openai_body

    body = json.dumps({"prompt": list(range(1 << 17, (1 << 17) + 150_000)), "max_tokens": 2}).encode()
    assert len(body) > openai_api.BIG_BODY_BYTES

    async def scenario() -> int:
        ticks = 0
        parsing = True

        async def tick() -> None:
            nonlocal ticks
            while parsing:
                await asyncio.sleep(0)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        ticks = 0
        parsed = await asyncio.get_running_loop().run_in_executor(openai_api._PARSING, openai_body.parse_json,
                                                                  body, True)
        parsing = False
        await ticker
        assert parsed == json.loads(body)
        return ticks

    assert asyncio.run(scenario()) > 1  # parsed on the loop, or holding the GIL throughout, it would be 0 or 1


def test_a_short_prompt_is_tokenized_while_a_long_one_still_runs() -> None:
    """Two lanes: a prompt over SHORT_PROMPT_CHARS takes the long lane, so a short prompt never waits behind it.
    The long prompt's tokenizing is held until the short one is done: with one lane this would deadlock."""
    import threading

    from gateway import request as requests

    long_started, short_done = threading.Event(), threading.Event()

    class Tokenizer:
        chat_template = None

        def get_vocab(self) -> dict[str, int]:
            return {"x" * 16: 0}

        def encode(self, text: str) -> list[int]:
            if len(text) > requests.SHORT_PROMPT_CHARS:
                long_started.set()
                assert short_done.wait(30), "the short prompt waited behind the long one"
            return [1] * min(len(text), 10)

    async def scenario() -> None:
        tokenizer = Tokenizer()
        long = asyncio.ensure_future(requests.parse_request(
            GenerateInput(prompt="y" * (requests.SHORT_PROMPT_CHARS + 1), max_tokens=1), tokenizer,
            100, 4096))
        assert await asyncio.to_thread(long_started.wait, 30)
        short = await requests.parse_request(GenerateInput(prompt="hello", max_tokens=1), tokenizer,
                                             100, 4096)
        short_done.set()
        assert short.prompt_ids == [1] * 5 and len((await long).prompt_ids) == 10

    asyncio.run(scenario())


def test_a_tokenizing_job_whose_deadline_passed_is_dropped_unrun() -> None:
    from gateway import request as requests

    ran = []

    class Tokenizer:
        chat_template = None

        def get_vocab(self) -> dict[str, int]:
            return {"x": 0}

        def encode(self, text: str) -> list[int]:
            ran.append(text)
            return [1]

    async def scenario() -> None:
        past = asyncio.get_running_loop().time() - 1
        with pytest.raises(requests.InvalidRequest, match="deadline passed"):
            await requests.parse_request(GenerateInput(prompt="hello"), Tokenizer(), 100, 4096,
                                         deadline=past)

    asyncio.run(scenario())
    assert ran == []


def test_refusals_for_capacity_are_logged_once_a_second_with_how_many_they_stand_for(
        caplog: pytest.LogCaptureFixture) -> None:
    """A client flooding past its cap is refused hundreds of times a second: one line stands for them all."""
    from serving.logs import SampledLog
    sampled = SampledLog(logging.getLogger("gateway.server"), "RESOURCE_EXHAUSTED", every_s=3600)
    with caplog.at_level(logging.INFO, logger="gateway.server"):
        for _ in range(500):
            sampled.log("over its cap")
        sampled._last -= 3600  # an hour on
        sampled.log("over its cap")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["ended with RESOURCE_EXHAUSTED: over its cap",
                     "ended with RESOURCE_EXHAUSTED: over its cap (and 499 more since the last such line)"]
