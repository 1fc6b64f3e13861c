"""Admission and back-pressure: a bounded number running, a bounded queue, refusal at once beyond it, and a slow
reader that slows only its own stream."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from gateway.admission import Admission, AdmissionConfig, Overloaded
from pdserve.client import generate, stream
from protos import decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, worker_pb2
from tests.helpers import assert_nothing_held, start_cluster


def test_places_queue_and_refusal() -> None:
    async def scenario() -> None:
        admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=1, queue_timeout_s=5))
        order: list[str] = []
        first_holds, first_done = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with admission.slot():
                order.append("first in")
                first_holds.set()
                await first_done.wait()

        async def second() -> None:
            async with admission.slot():
                order.append("second in")

        one = asyncio.ensure_future(first())
        await first_holds.wait()
        two = asyncio.ensure_future(second())
        await asyncio.sleep(0.01)
        assert admission.queued == 1
        # Refused at once: entering raises at its first step, before it could wait in line for anything.
        entering = admission.slot().__aenter__()
        with pytest.raises(Overloaded, match="1 requests running and 1 queued"):
            entering.send(None)
        assert admission.queued == 1
        first_done.set()
        await asyncio.gather(one, two)
        assert order == ["first in", "second in"]  # the place went straight to the one in line
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_queue_timeout_and_cancelled_waiters_leave_no_place_behind() -> None:
    async def scenario() -> None:
        admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=4, queue_timeout_s=0.2))
        release = asyncio.Event()

        async def hold() -> None:
            async with admission.slot():
                await release.wait()

        holder = asyncio.ensure_future(hold())
        await asyncio.sleep(0)
        started = time.perf_counter()
        with pytest.raises(Overloaded, match="within 0.2 s"):
            async with admission.slot():
                pass
        # the queue timeout ended the wait: not before it, and long before the holder lets go (it never does here)
        assert 0.15 < time.perf_counter() - started < 10
        waiter = asyncio.ensure_future(admission.slot().__aenter__())
        await asyncio.sleep(0.01)
        waiter.cancel()  # the client left while queued
        await asyncio.gather(waiter, return_exceptions=True)
        release.set()
        await holder
        assert (admission.running, admission.queued) == (0, 0)
        async with admission.slot():  # the place is free again
            assert admission.running == 1

    asyncio.run(scenario())


def test_gateway_refuses_beyond_its_queue_with_a_retry_hint(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir, gateway_args=("--max-in-flight=1", "--max-queue=0"))
    try:
        address = cluster.gateway.address
        responses = stream(address, 60, prompt="Tell me a long story", max_tokens=400, ignore_eos=True)
        next(responses)  # it holds the only place
        with grpc.insecure_channel(address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=2), timeout=30)
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # refused at once for the full queue, not at the end of a wait in it ("no place ... within")
        assert "the most it takes" in (refused.value.details() or "")
        hints = dict(refused.value.trailing_metadata() or ())
        assert int(hints["retry-after-ms"]) > 0
        responses.close()  # type: ignore[attr-defined]
        assert generate(address, timeout=30, prompt="Hi", max_tokens=2).finish_reason  # room again
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


def test_a_request_waits_for_decode_room_instead_of_failing(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir, decode_args=("--max-seqs=1",))
    try:
        address = cluster.gateway.address
        responses = stream(address, 60, prompt="Tell me a long story", max_tokens=60, ignore_eos=True)
        first = next(responses)  # the decode worker's only slot is taken
        waiting = generate(address, timeout=60, prompt="Hi", max_tokens=2)  # reserves once the slot frees
        assert waiting.finish_reason
        assert len(first.token_ids) + sum(len(r.token_ids) for r in responses) == 60
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


def test_a_client_that_stops_reading_holds_back_neither_the_batch_nor_other_streams(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir, decode=1)
    try:
        address = cluster.gateway.address
        slow = stream(address, 60, prompt="Tell me a long story", max_tokens=200, ignore_eos=True)
        received = list(next(slow).token_ids)  # then it stops reading
        fast = generate(address, timeout=60, prompt="Hi", max_tokens=100, ignore_eos=True)
        assert len(fast.token_ids) == 100  # decoded in the same batch, unhindered
        with grpc.insecure_channel(cluster.decode[0].address) as channel:
            decode = decode_pb2_grpc.DecodeStub(channel)
            deadline = time.monotonic() + 30
            # the slow stream's sequence finishes and leaves the batch: its remaining tokens wait in its own
            # bounded buffer (at most max_tokens token ids), not in the batch
            while decode.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5).live_sequences:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        last = None
        for response in slow:
            received += response.token_ids
            last = response
        assert len(received) == 200 and last is not None and last.finish_reason == "length"  # nothing lost
        assert_nothing_held(cluster)
    finally:
        cluster.stop()
