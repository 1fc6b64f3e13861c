"""Retries and migration, with real processes: a worker SIGKILLed before or during a request.

A prefill worker that dies is retried on the other one; a decode worker that dies mid-stream hands the stream
to the other, and the client sees one stream, no token repeated or missing, the tokens of an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from decode_service.config import DecodeConfig
from decode_service.server import DecodeServicer
from model_runner.loading import ModelConfig
from pdserve.client import generate, stream
from pdserve.cluster import Cluster, Service
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillServicer
from protos import decode_pb2, prefill_pb2
from serving.server import ServerConfig
from tests.helpers import GREEDY, POEM, assert_nothing_held, decoding_worker, start_cluster


def _kill(cluster: Cluster, service: Service) -> None:
    service.process.send_signal(signal.SIGKILL)
    service.process.wait(timeout=10)
    for pool in (cluster.prefill, cluster.decode):
        if service in pool:
            pool.remove(service)  # the leak checks ask the living only


@pytest.fixture
def two_by_two(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = start_cluster(tiny_model_dir, prefill=2, decode=2, decode_args=("--lease=3",))
    yield cluster
    cluster.stop()


def test_requests_after_a_prefill_worker_is_killed_are_retried_on_the_other(two_by_two: Cluster) -> None:
    address = two_by_two.gateway.address
    fields = {"prompt": POEM, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    expected = generate(address, timeout=60, **fields).token_ids
    _kill(two_by_two, two_by_two.prefill[0])
    completions = [generate(address, timeout=60, **fields) for _ in range(4)]
    assert [c.token_ids for c in completions] == [expected] * 4
    assert all(c.finish_reason == "length" for c in completions)
    # round robin sends one of the first two to the dead worker: it is retried, then its breaker keeps it last
    assert 1 <= sum(c.timing.retries for c in completions) <= 2
    assert all(c.timing.migrations == 0 for c in completions)
    assert_nothing_held(two_by_two)


def test_a_stream_whose_decode_worker_is_killed_migrates_without_losing_or_repeating_a_token(
    two_by_two: Cluster,
) -> None:
    address = two_by_two.gateway.address
    fields = {"prompt": POEM, "max_tokens": 300, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    expected = generate(address, timeout=60, **fields).token_ids
    assert len(expected) == 300
    received: list[int] = []
    final = None
    for response in stream(address, 60, **fields):
        received += response.token_ids
        if final is None and len(received) >= 5:
            final = False
            _kill(two_by_two, decoding_worker(two_by_two))  # mid-stream, tokens already on their way
        if response.finish_reason:
            final = response
    assert final is not None and final is not False
    assert received == expected  # seeded sampling is keyed by position: the continuation picks the same tokens
    assert final.finish_reason == "length" and final.usage.completion_tokens == 300
    assert final.timing.migrations == 1
    assert_nothing_held(two_by_two)


def test_a_failure_that_another_worker_cannot_fix_is_not_retried(two_by_two: Cluster) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(two_by_two.gateway.address, timeout=60, prompt=POEM, max_tokens=10**6)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for service in list(two_by_two.decode):
        _kill(two_by_two, service)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as unavailable:
        generate(two_by_two.gateway.address, timeout=60, prompt=POEM, max_tokens=4)
    assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker reachable" in (unavailable.value.details() or "")
    assert time.monotonic() - started < 10  # bounded retries with backoff, not a hang


class _Refused(Exception):
    pass


class _Context:
    """The little of grpc.aio.ServicerContext that a servicer's request path uses before its engine takes over."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Refused(code, details)

    def add_done_callback(self, callback: object) -> None:
        pass  # the call's end: not reached here


def test_both_services_hand_a_migrated_stream_s_decoded_tokens_to_their_engine(tiny_model_dir: Path) -> None:
    """What makes a migration bit-identical (the engine replays the sent tokens, tests/test_fast_runner.py) needs
    each servicer to pass `decoded_tokens` on: prefill's PromptJob and a colocated request's prompt pass."""
    model = ModelConfig(model=str(tiny_model_dir))
    runner = model.load()
    prefill = PrefillServicer(PrefillConfig(server=ServerConfig(), model=model, prefix_cache_mb=0), runner)
    decode = DecodeServicer(DecodeConfig(server=ServerConfig(), model=model, kv_warm_mb=0), runner)
    jobs, prompts = [], []
    prefill.worker.engine.submit = lambda job: (jobs.append(job), job.abandon.set())  # type: ignore[method-assign]
    decode.worker.engine.submit_prompt = lambda seq, prompt, decoded=0, cache_salt="": prompts.append(  # type: ignore[method-assign]
        (list(prompt), decoded))

    async def requests() -> None:
        events = prefill._prefill(prefill_pb2.PrefillRequest(
            request_id="p", token_ids=[5, 6, 7, 8, 9], sampling=GREEDY, decode_address="127.0.0.1:1",
            reservation_token="t", decoded_tokens=2), _Context())  # type: ignore[arg-type]
        task = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.2)  # the job is submitted (and abandoned by the stub above), its result never comes
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await events.aclose()
        stream = decode._generate(decode_pb2.DecodeRequest(
            request_id="d", prompt_tokens=5, max_tokens=3, sampling=GREEDY, prompt_token_ids=[5, 6, 7, 8, 9],
            decoded_tokens=2), _Context())  # type: ignore[arg-type]
        assert (await stream.__anext__()).WhichOneof("event") == "reserved"
        await stream.aclose()

    try:
        asyncio.run(requests())
    finally:
        prefill.worker.engine.close()
        decode.worker.engine.close()
    assert [(job.token_ids, job.decoded) for job in jobs] == [([5, 6, 7, 8, 9], 2)]
    assert prompts == [([5, 6, 7, 8, 9], 2)]
