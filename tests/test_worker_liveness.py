"""Workers that freeze, leave DNS or fail right after a stream's last token, as the gateway sees them.

The journey's own cases run against fake worker calls whose every event the test releases; the rest run real
workers: a frozen one (SIGSTOP), one that leaves DNS under load and one rolled away, and a Cancel that lands while
the gateway waits to write to a slow client.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway import journey
from gateway.admission import AdmissionConfig
from gateway.core import Gateway
from gateway.errors import GatewayError, NoDecodeCapacity
from gateway.failover import RetryPolicy, run_with_failover
from gateway.journey import Timings, Tokens
from gateway.placement import Placement
from gateway.request import GenerateParams
from gateway.server import GatewayServicer
from gateway.workers import Colocation, Pool, check_pairing, resolve
from pdserve.client import generate, stream
from pdserve.cluster import Cluster, Service
from protos import decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2, worker_pb2
from protos.types import SamplingParams
from tests.helpers import POEM, assert_nothing_held, start_cluster

# Fake workers. A script is the list of what a call's reads return in turn: an event, an exception to raise, or
# an asyncio.Event to wait for first. After the last entry the worker is silent, as a frozen one is.

EOS = 2
PROMPT_IDS = [1, 5, 9]
ANSWER = [11, 12, 13, 14, 15, 16, 17, 18]  # what the fake model generates after PROMPT_IDS, in order


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


RESERVED = decode_pb2.DecodeEvent(reserved=decode_pb2.Reservation(token="t"))
UNAVAILABLE = _error(grpc.StatusCode.UNAVAILABLE, "worker died")


def _tokens(token_ids: list[int], finish_reason: str = "") -> decode_pb2.DecodeEvent:
    return decode_pb2.DecodeEvent(tokens=decode_pb2.DecodedTokens(token_ids=token_ids, finish_reason=finish_reason))


class FakeCall:
    """A grpc.aio unary-stream call playing a script. cancel() makes a waiting or later read raise CancelledError
    without cancelling the reader's task: what grpc.aio does to a call cancelled locally or whose channel closed."""

    def __init__(self, script: list[Any]) -> None:
        self._script = script
        self._cancelled = asyncio.Event()

    async def read(self) -> Any:
        while True:
            if self._cancelled.is_set():
                raise asyncio.CancelledError()
            if not self._script:  # silent from now on
                await self._cancelled.wait()
                continue
            step = self._script.pop(0)
            if isinstance(step, asyncio.Event):
                waits = [asyncio.ensure_future(step.wait()), asyncio.ensure_future(self._cancelled.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for wait in waits:
                        wait.cancel()
                continue
            if isinstance(step, BaseException):
                raise step
            return step

    def cancel(self) -> bool:
        self._cancelled.set()
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class FakeStub:
    """A worker's stub: each Generate (decode) or Prefill call plays the script `play(request)` returns."""

    play: Callable[[Any], list[Any]]
    requests: list[Any] = field(default_factory=list)
    calls: list[FakeCall] = field(default_factory=list)

    def _call(self, request: Any, **_: Any) -> FakeCall:
        self.requests.append(request)
        self.calls.append(FakeCall(self.play(request)))
        return self.calls[-1]

    Generate = Prefill = _call


def fake_prefill(answer: list[int]) -> Callable[[prefill_pb2.PrefillRequest], list[Any]]:
    """A prefill worker of a fake model that answers PROMPT_IDS with `answer`: the next token after the request's
    tokens, then the KV acknowledged."""
    def play(request: prefill_pb2.PrefillRequest) -> list[Any]:
        token = answer[len(request.token_ids) - len(PROMPT_IDS)]
        return [prefill_pb2.PrefillEvent(first_token=prefill_pb2.FirstToken(token_id=token)),
                prefill_pb2.PrefillEvent(transfer_done=prefill_pb2.TransferDone())]

    return play


def fake_decode(answer: list[int] = ANSWER) -> FakeStub:
    """A healthy decode worker: refuses what decode_service refuses, else streams the rest of `answer`."""
    def play(request: decode_pb2.DecodeRequest) -> list[Any]:
        if request.max_tokens < 1:
            return [_error(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1")]
        start = request.prompt_tokens - len(PROMPT_IDS) + 1  # the token after prefill's
        return [RESERVED, _tokens(answer[start : start + request.max_tokens - 1], "length")]

    return FakeStub(play)


def _params(max_tokens: int, ignore_eos: bool = False) -> GenerateParams:
    return GenerateParams("r1", PROMPT_IDS, max_tokens, SamplingParams(temperature=0.0), [], ignore_eos)


def _pools(*decode: FakeStub, answer: list[int] = ANSWER) -> tuple[Pool, Pool]:
    """One fake prefill worker and these decode workers, tried in this order while none has failed."""
    prefill = Pool("prefill", ["127.0.0.1:1"])
    prefill.workers[0].stub = FakeStub(fake_prefill(answer))
    pool = Pool("decode", [f"127.0.0.1:{10 + i}" for i in range(len(decode))])
    for worker, stub in zip(pool.workers, decode):
        worker.stub = stub
    return prefill, pool


async def _journey(params: GenerateParams, prefill: Pool, decode: Pool, policy: RetryPolicy | None = None,
                   after_first: asyncio.Event | None = None, eos: frozenset[int] = frozenset({EOS}),
                   ) -> tuple[list[Tokens], Timings]:
    """The journey's pieces; `after_first` is set once the first token reached the caller."""
    timings, pieces = Timings(), []
    tokens = run_with_failover(params, prefill, decode, timings, None, False, policy or RetryPolicy(), None,
                                       eos)
    async for piece in tokens:
        pieces.append(piece)
        if after_first is not None:
            after_first.set()
    return pieces, timings


def _held_calls(*pools: Pool) -> list[int]:
    return [worker.calls for pool in pools for worker in pool.workers + pool.leaving]


def test_a_decode_worker_failing_right_after_a_max_tokens_1_answer_finishes_it_instead_of_migrating() -> None:
    async def scenario() -> None:
        delivered = asyncio.Event()
        dying, spare = FakeStub(lambda _: [RESERVED, delivered, UNAVAILABLE]), fake_decode()
        prefill, decode = _pools(dying, spare)
        pieces, timings = await asyncio.wait_for(_journey(_params(max_tokens=1), prefill, decode,
                                                          after_first=delivered), 10)
        # prefill's token was the whole answer: a continuation with max_tokens=0 (refused INVALID_ARGUMENT) never
        # starts, and the client sees its finish, not an error
        assert pieces == [Tokens([ANSWER[0]]), Tokens([], "length")]
        assert spare.requests == [] and timings.migrations == 0
        assert _held_calls(prefill, decode) == [0, 0, 0]
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_decode_worker_failing_right_after_an_eos_first_token_ends_the_stream_there(ignore_eos: bool) -> None:
    async def scenario() -> None:
        answer = [EOS, *ANSWER[1:]]  # the model's first token is eos
        delivered = asyncio.Event()
        dying, spare = FakeStub(lambda _: [RESERVED, delivered, UNAVAILABLE]), fake_decode(answer)
        prefill, decode = _pools(dying, spare, answer=answer)
        pieces, timings = await asyncio.wait_for(_journey(_params(5, ignore_eos), prefill, decode,
                                                          after_first=delivered), 10)
        if ignore_eos:  # eos is just a token: the stream migrates and goes on past it
            assert [t for piece in pieces for t in piece.token_ids] == [EOS, *ANSWER[1:5]]
            assert pieces[-1].finish_reason == "length" and timings.migrations == 1
        else:
            assert pieces == [Tokens([EOS]), Tokens([], "stop")]
            assert spare.requests == [] and timings.migrations == 0
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


def test_a_decode_worker_silent_mid_stream_past_the_idle_timeout_is_left_and_the_stream_migrates() -> None:
    async def scenario() -> None:
        frozen, spare = FakeStub(lambda _: [RESERVED, _tokens([ANSWER[1]])]), fake_decode()
        prefill, decode = _pools(frozen, spare)
        started = time.monotonic()
        pieces, timings = await asyncio.wait_for(
            _journey(_params(6), prefill, decode, RetryPolicy(idle_timeout_s=0.3)), 10)
        assert [t for piece in pieces for t in piece.token_ids] == ANSWER[:6]
        assert pieces[-1].finish_reason == "length" and timings.migrations == 1
        assert time.monotonic() - started >= 0.3
        assert frozen.calls[0].cancelled  # the frozen worker's call is ended, so it frees the slot when it wakes
        assert decode.workers[0].failures == 1  # and its breaker opened: it goes last for a while
        assert spare.requests[0].prompt_tokens == 5 and spare.requests[0].max_tokens == 4
        # the prefill worker is told that the 2 tokens sent were decoded: it replays them as decode steps did
        assert [r.decoded_tokens for r in prefill.workers[0].stub.requests] == [0, 2]
        assert _held_calls(prefill, decode) == [0, 0, 0]
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


def test_a_second_migration_marks_every_token_sent_so_far_decoded() -> None:
    async def scenario() -> None:
        first, second = (FakeStub(lambda _: [RESERVED, _tokens([ANSWER[1]]), UNAVAILABLE]),
                         FakeStub(lambda _: [RESERVED, _tokens([ANSWER[3]]), UNAVAILABLE]))
        prefill, decode = _pools(first, second, fake_decode())
        pieces, timings = await asyncio.wait_for(_journey(_params(7), prefill, decode), 10)
        assert [t for piece in pieces for t in piece.token_ids] == ANSWER[:7] and timings.migrations == 2
        requests = prefill.workers[0].stub.requests
        assert [(len(r.token_ids), r.decoded_tokens) for r in requests] == [(3, 0), (5, 2), (7, 4)]
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


def test_a_colocated_stream_migrates_with_its_sent_tokens_marked_decoded() -> None:
    async def scenario() -> None:
        # colocated, the decode worker sends every token, the first one too
        dying = FakeStub(lambda _: [RESERVED, _tokens(ANSWER[:3]), UNAVAILABLE])
        spare = FakeStub(lambda r: [RESERVED, _tokens(ANSWER[len(r.prompt_token_ids) - len(PROMPT_IDS):][:3],
                                                      "length")])
        prefill, decode = _pools(dying, spare)
        timings = Timings()
        pieces = [piece async for piece in run_with_failover(
            _params(6), prefill, decode, timings, None, True, RetryPolicy(), None, frozenset({EOS}))]
        assert [t for piece in pieces for t in piece.token_ids] == ANSWER[:6] and timings.migrations == 1
        first, again = dying.requests[0], spare.requests[0]
        assert (list(first.prompt_token_ids), first.decoded_tokens) == (PROMPT_IDS, 0)
        assert (list(again.prompt_token_ids), again.decoded_tokens) == (PROMPT_IDS + ANSWER[:3], 3)
        assert again.prompt_tokens == 6 and again.max_tokens == 3
        assert prefill.workers[0].stub.requests == []
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


def test_reserve_does_not_wait_forever_on_a_frozen_worker_when_the_healthy_ones_are_full() -> None:
    async def scenario() -> None:
        full = FakeStub(lambda _: [_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker full")])
        frozen = FakeStub(lambda _: [])  # never answers the reservation
        _, decode = _pools(full, frozen)
        started = time.monotonic()
        with pytest.raises(NoDecodeCapacity):  # the request then waits for room, within --queue-timeout
            await asyncio.wait_for(journey.reserve(_params(4), decode, None, idle_timeout_s=0.3), 10)
        assert time.monotonic() - started >= 0.3  # the idle timeout's, no sooner; wait_for bounds it above
        assert frozen.calls[0].cancelled and decode.workers[1].failures == 1
        await decode.close()

    asyncio.run(scenario())


def test_a_worker_call_cancelled_under_the_stream_migrates_it_and_only_the_callers_own_cancel_cancels() -> None:
    async def scenario() -> None:
        # grpc.aio raises CancelledError from a read when the call's channel is closed (a worker leaving the pool)
        closed = FakeStub(lambda _: [RESERVED, _tokens([ANSWER[1]]), asyncio.CancelledError()])
        prefill, decode = _pools(closed, fake_decode())
        pieces, timings = await asyncio.wait_for(_journey(_params(6), prefill, decode), 10)
        assert [t for piece in pieces for t in piece.token_ids] == ANSWER[:6] and timings.migrations == 1
        await prefill.close()
        await decode.close()

        # The caller's own cancel still ends the request: CancelledError out, every worker call cancelled.
        silent = FakeStub(lambda _: [RESERVED])
        prefill, decode = _pools(silent)
        delivered = asyncio.Event()
        task = asyncio.ensure_future(_journey(_params(6), prefill, decode, after_first=delivered))
        await asyncio.wait_for(delivered.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert silent.calls[0].cancelled and prefill.workers[0].stub.calls[0].cancelled
        assert _held_calls(prefill, decode) == [0, 0]
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


def test_a_stream_closed_at_a_token_has_cancelled_its_worker_calls_when_close_returns() -> None:
    """How the gateway ends a request whose client went away while a token was on its way to it: the attempt's
    calls end then, not when the garbage collector or the loop's generator finalizer gets to them (a decode
    worker would keep the reservation, its KV budget and a lent segment, meanwhile)."""
    async def scenario() -> None:
        silent = FakeStub(lambda _: [RESERVED])
        prefill, decode = _pools(silent)
        tokens = run_with_failover(_params(6), prefill, decode, Timings(), None, False, RetryPolicy(), None)
        assert (await asyncio.wait_for(anext(tokens), 10)).token_ids == [ANSWER[0]]
        await tokens.aclose()
        assert silent.calls[0].cancelled and prefill.workers[0].stub.calls[0].cancelled
        assert _held_calls(prefill, decode) == [0, 0]
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


def test_a_failure_after_the_last_token_that_no_retry_could_fix_still_ends_with_the_finish() -> None:
    async def scenario() -> None:
        delivered = asyncio.Event()
        broken = FakeStub(lambda _: [RESERVED, delivered, _error(grpc.StatusCode.INVALID_ARGUMENT, "bad")])
        prefill, decode = _pools(broken)
        pieces, _ = await asyncio.wait_for(_journey(_params(1), prefill, decode, after_first=delivered), 10)
        assert pieces == [Tokens([ANSWER[0]]), Tokens([], "length")]
        await prefill.close()
        await decode.close()
        # before the last token the same failure is the client's
        delivered = asyncio.Event()
        broken = FakeStub(lambda _: [RESERVED, delivered, _error(grpc.StatusCode.INVALID_ARGUMENT, "bad")])
        prefill, decode = _pools(broken)
        with pytest.raises(GatewayError) as failed:
            await asyncio.wait_for(_journey(_params(2), prefill, decode, after_first=delivered), 10)
        assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT
        await prefill.close()
        await decode.close()

    asyncio.run(scenario())


# Real workers.


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path) -> Iterator[Cluster]:
    """Workers for a gateway run inside the test (its pools and server options are the test's to set); a
    decode worker stops at once on SIGTERM (--grace=0), as one whose grace ran out."""
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=2, decode_args=("--grace=0",))
    yield cluster
    cluster.stop()


@contextlib.asynccontextmanager
async def _gateway(cluster: Cluster, model_dir: Path, decode_names: list[str] | None = None,
                   resolver: Callable[[str, int], list[str]] | None = None,
                   server_options: list[tuple[str, Any]] | None = None) -> AsyncIterator[tuple[GatewayServicer, str]]:
    """The gateway, in this process, over `cluster`'s workers; decode workers under `decode_names` as `resolver`
    resolves them. Health and load are polled every 0.1 s; names are re-resolved only by Pool.refresh."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prefill = Pool("prefill", [service.address for service in cluster.prefill])
    decode = Pool("decode", decode_names or [service.address for service in cluster.decode],
                  resolver=resolver or resolve)
    await asyncio.gather(prefill.fetch_info(30), decode.fetch_info(30))
    servicer = GatewayServicer(Gateway(tokenizer, check_pairing(prefill, decode), prefill, decode,
                                       Placement("threshold", Colocation()), RetryPolicy(), AdmissionConfig()))
    polls = [asyncio.ensure_future(pool.poll(0.1, resolve_every_s=1e9)) for pool in (prefill, decode)]
    server = grpc.aio.server(options=server_options)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        for poll in polls:
            poll.cancel()
        await server.stop(None)
        await prefill.close()
        await decode.close()


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class Run:
    """One client's stream, as it went: the tokens, the last response, and the status it ended with."""

    token_ids: list[int] = field(default_factory=list)
    last: gateway_pb2.GenerateResponse | None = None
    code: grpc.StatusCode | None = None


async def _run(address: str, fields: dict[str, Any], run: Run | None = None) -> Run:
    run = run or Run()
    async with grpc.aio.insecure_channel(address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(**fields), timeout=90)
        try:
            async for response in call:
                run.token_ids += response.token_ids
                run.last = response
        except grpc.aio.AioRpcError:
            pass
        run.code = await call.code()
    return run


def _requests(count: int, temperature: float = 0.0) -> list[dict[str, Any]]:
    """Seeded when sampled: sampling is keyed by (seed, position), so a migrated stream picks the same tokens."""
    return [{"prompt": f"{POEM} ({i})", "max_tokens": 100, "temperature": temperature, "seed": i,
             "ignore_eos": True} for i in range(count)]


def test_a_cancel_landing_while_the_gateway_waits_to_write_to_a_slow_client_still_sends_it_a_status(
    workers: Cluster, tiny_model_dir: Path,
) -> None:
    async def scenario() -> None:
        # A gateway that hands a response over only as the client takes it, and a client that takes one at a time.
        async with _gateway(workers, tiny_model_dir, server_options=[("grpc.http2.write_buffer_size", 1)]) as (
                servicer, address):
            slow_options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
            async with grpc.aio.insecure_channel(address, options=slow_options) as slow, \
                    grpc.aio.insecure_channel(address) as other:
                request = gateway_pb2.GenerateRequest(request_id="slow", prompt=POEM, max_tokens=100,
                                                      temperature=0.0, ignore_eos=True)
                call = gateway_pb2_grpc.GatewayStub(slow).Generate(request, timeout=90)
                assert (await call.read()).token_ids
                # 1. The client reads no more. Once decode is done, every token waits in the gateway, whose
                #    handler can only be waiting to write the next response.
                infos: list[worker_pb2.WorkerInfo] = []

                async def decode_idle() -> bool:
                    infos[:] = [await w.stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5)
                                for w in servicer.gateway.decode.workers]
                    return all(i.live_sequences == 0 and i.live_reservations == 0 for i in infos)

                deadline = time.monotonic() + 30
                while not await decode_idle():
                    assert time.monotonic() < deadline, f"decode still busy: {infos}"
                    await asyncio.sleep(0.05)
                assert ("", "slow") in servicer.gateway._in_flight  # (tenant, request id); no API keys: one tenant
                # 2. Cancel lands there.
                cancelled = await gateway_pb2_grpc.GatewayStub(other).Cancel(
                    gateway_pb2.CancelRequest(request_id="slow"), timeout=10)
                assert cancelled.cancelled
                # 3. The client reads on: what was being written, then the status (not a stream left hanging).
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    for _ in range(100):
                        response = await asyncio.wait_for(call.read(), 10)
                        assert response is not grpc.aio.EOF and not response.finish_reason
                assert ended.value.code() == grpc.StatusCode.CANCELLED
                assert "Cancel call" in (ended.value.details() or "")
                await _until(lambda: not servicer.gateway._in_flight, "the gateway to let the request go", 5)
        assert_nothing_held(workers)

    asyncio.run(scenario())


class _Aborted(Exception):
    pass


@dataclass
class _WriteGate:
    """A servicer context whose second write stays in progress until `release` is set: where grpc.aio's write
    waits on gRPC core. Cancelling the handler there left the write's operation pending in core, which then
    refused the status (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS): the client waited forever (1 stream in 400
    Cancels of a soak). The handler must therefore never be cancelled mid-write."""

    writing: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    writes: list[str] = field(default_factory=list)  # "done" or "interrupted", one per write
    status: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def time_remaining(self) -> None:
        return None

    async def write(self, response: gateway_pb2.GenerateResponse) -> None:
        if len(self.writes) == 1:
            self.writing.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.writes.append("interrupted")
                raise
        self.writes.append("done")

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        self.status = code, details
        raise _Aborted


def test_a_cancel_never_interrupts_a_write_and_ends_the_request_once_the_write_is_done(
    workers: Cluster, tiny_model_dir: Path,
) -> None:
    async def scenario() -> None:
        async with _gateway(workers, tiny_model_dir) as (servicer, _):
            context = _WriteGate()
            request = gateway_pb2.GenerateRequest(request_id="mid-write", prompt=POEM, max_tokens=100,
                                                  temperature=0.0, ignore_eos=True)
            handler = asyncio.ensure_future(servicer.Generate(request, context))  # type: ignore[arg-type]
            await asyncio.wait_for(context.writing.wait(), 30)
            # the Cancel lands while the second response is being written: acknowledged, deferred
            reply = await servicer.Cancel(gateway_pb2.CancelRequest(request_id="mid-write"), context)  # type: ignore[arg-type]
            assert reply.cancelled
            await asyncio.sleep(0.2)
            assert not handler.done() and context.writes == ["done"]
            # the write finishes; the handler then ends the request with CANCELLED, writing nothing more
            context.release.set()
            with pytest.raises(_Aborted):
                await asyncio.wait_for(handler, 10)
            assert context.writes == ["done", "done"]
            assert context.status == (grpc.StatusCode.CANCELLED, "request was cancelled by a Cancel call")
            assert not servicer.gateway._in_flight and not servicer.gateway._tasks and not servicer._writing
            assert cancellations(servicer) == 1
            # the client's own cancel mid-write (grpc.aio cancels the handler): no status owed, counted once too
            context = _WriteGate()
            handler = asyncio.ensure_future(servicer.Generate(request, context))  # type: ignore[arg-type]
            await asyncio.wait_for(context.writing.wait(), 30)
            handler.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(handler, 10)
            assert context.writes == ["done", "interrupted"] and context.status is None
            assert not servicer.gateway._in_flight and not servicer.gateway._tasks and not servicer._writing
            assert cancellations(servicer) == 2
        assert_nothing_held(workers)

    def cancellations(servicer: GatewayServicer) -> float:
        value = servicer.gateway.metrics.registry.get_sample_value("pdserve_cancellations_total")
        assert value is not None
        return value

    asyncio.run(scenario())


def test_a_decode_worker_leaving_dns_finishes_its_streams_and_one_rolled_away_hands_them_over(
    workers: Cluster, tiny_model_dir: Path,
) -> None:
    async def scenario() -> None:
        answers = {"decode-0.test": ["127.0.0.1"], "decode-1.test": ["127.0.0.1"]}
        names = [f"decode-{i}.test:{service.address.rsplit(':', 1)[1]}" for i, service in enumerate(workers.decode)]
        async with _gateway(workers, tiny_model_dir, names, lambda host, port: answers[host]) as (servicer, address):
            decode = servicer.gateway.decode
            requests = _requests(4, temperature=0.9)  # the random tiny model's greedy answer repeats one token
            expected = [(await _run(address, fields)).token_ids for fields in requests]  # one at a time

            async def streams_under_way() -> tuple[list[Run], asyncio.Future]:
                runs = [Run() for _ in requests]
                done = asyncio.gather(*(_run(address, fields, run) for fields, run in zip(requests, runs)))
                await _until(lambda: all(len(run.token_ids) >= 3 for run in runs), "every stream to start")
                return runs, done

            # 1. decode-0 leaves DNS mid-stream (scaled down, or only unready): new requests go elsewhere, and its
            #    streams go on where they are, its channel open until they end.
            runs, done = await streams_under_way()
            leaving = decode.workers[0]
            assert leaving.calls > 0  # least loaded first: the four streams are spread over both
            answers["decode-0.test"] = []
            await decode.refresh()
            assert decode.leaving == [leaving] and leaving not in decode.workers
            await asyncio.wait_for(done, 60)
            assert [run.code for run in runs] == [grpc.StatusCode.OK] * 4
            assert [run.token_ids for run in runs] == expected
            assert all(run.last is not None and run.last.timing.migrations == 0 for run in runs)
            await _until(lambda: not decode.leaving, "its channel to close once its streams ended", 5)

            # 2. It comes back. Then decode-1 leaves DNS and stops at once (a rollout past its grace): its streams
            #    move to decode-0, and every client gets all its tokens and a status.
            answers["decode-0.test"] = ["127.0.0.1"]
            await decode.refresh()
            await _until(lambda: all(w.serving for w in decode.workers), "decode-0 to serve again", 10)
            runs, done = await streams_under_way()
            rolled = next(w for w in decode.workers if w.address == workers.decode[1].address)
            assert rolled.calls > 0
            answers["decode-1.test"] = []
            await decode.refresh()
            workers.decode[1].process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(done, 60)
            assert [run.code for run in runs] == [grpc.StatusCode.OK] * 4
            assert [run.token_ids for run in runs] == expected
            assert sum(run.last.timing.migrations for run in runs if run.last is not None) >= 1
        workers.decode[1].process.wait(timeout=10)
        workers.decode.remove(workers.decode[1])
        assert_nothing_held(workers)

    asyncio.run(scenario())


@dataclass
class Streamed:
    token_ids: list[int] = field(default_factory=list)
    last: gateway_pb2.GenerateResponse | None = None


def _concurrently(address: str, requests: list[dict[str, Any]], once_all_started: Callable[[], None] = lambda: None,
                  started_at: int = 5) -> list[Streamed]:
    """Every request streamed at once, one client thread each; `once_all_started` runs once every stream has
    `started_at` tokens."""
    runs = [Streamed() for _ in requests]
    lock, fired = threading.Lock(), threading.Event()

    def client(fields: dict[str, Any], run: Streamed) -> None:
        for response in stream(address, 90, **fields):
            run.token_ids += response.token_ids
            run.last = response
            with lock:
                if fired.is_set() or not all(len(r.token_ids) >= started_at for r in runs):
                    continue
                fired.set()
            once_all_started()

    threads = [threading.Thread(target=client, args=(fields, run)) for fields, run in zip(requests, runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a client still waits"
    return runs


def _busy(services: list[Service]) -> Service:
    """A decode worker running sequences now."""
    for service in services:
        with grpc.insecure_channel(service.address) as channel:
            info = decode_pb2_grpc.DecodeStub(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5)
        if info.live_sequences:
            return service
    raise AssertionError("no decode worker is running a sequence")


def test_a_decode_worker_frozen_mid_stream_under_8_greedy_streams_hands_them_all_over(tiny_model_dir: Path) -> None:
    """The streams move once the frozen worker is silent past the gateway's idle timeout (5 s), long before their
    90 s deadline: each ends with its finish reason. How soon after the freeze is not this test's to say."""
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=2)
    frozen: list[Service] = []
    try:
        requests = _requests(8)
        usual = _concurrently(cluster.gateway.address, requests)

        def freeze() -> None:  # SIGSTOP: the process holds its sockets open and answers nothing, not even pings
            frozen.append(_busy(cluster.decode))
            frozen[0].process.send_signal(signal.SIGSTOP)

        runs = _concurrently(cluster.gateway.address, requests, freeze)
        assert frozen
        assert [run.token_ids for run in runs] == [run.token_ids for run in usual]  # greedy: token-identical
        assert all(run.last is not None and run.last.finish_reason == "length" for run in runs)
        migrated = sum(run.last.timing.migrations for run in runs if run.last is not None)
        assert 1 <= migrated <= 8
    finally:
        for service in frozen:
            service.process.send_signal(signal.SIGKILL)
            service.process.send_signal(signal.SIGCONT)
            service.process.wait(timeout=10)
            cluster.decode.remove(service)
    try:
        assert_nothing_held(cluster, within_s=5)
    finally:
        cluster.stop()


def test_keepalive_finds_a_frozen_prefill_worker_and_its_request_is_retried_on_the_other(
    tiny_model_dir: Path,
) -> None:
    # Polls are rare here: only keepalive can tell the gateway that the worker froze.
    cluster = start_cluster(tiny_model_dir, prefill=2, decode=1,
                            gateway_args=("--keepalive=1", "--keepalive-timeout=1", "--poll-interval=60"))
    frozen = cluster.prefill[0]
    try:
        frozen.process.send_signal(signal.SIGSTOP)
        retries = 0
        for n in range(2):  # round robin: one of the two goes to the frozen worker
            # Found by a ping or two and its 1 s timeout; without keepalive the request would wait out its 20 s
            # deadline (DEADLINE_EXCEEDED) on the frozen worker.
            completion = generate(cluster.gateway.address, timeout=20, prompt=f"{POEM} {n}", max_tokens=4)
            assert completion.finish_reason == "length" and completion.timing is not None
            retries += completion.timing.retries
        assert retries == 1
    finally:
        frozen.process.send_signal(signal.SIGKILL)
        frozen.process.send_signal(signal.SIGCONT)
        frozen.process.wait(timeout=10)
        cluster.prefill.remove(frozen)
    try:
        assert_nothing_held(cluster, within_s=5)
    finally:
        cluster.stop()
