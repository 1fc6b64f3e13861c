"""Retries and migration, with real processes: a worker SIGKILLed before or during a request.

A prefill worker that dies is retried on the other one; a decode worker that dies mid-stream hands the stream
to the other, and the client sees one stream, no token repeated or missing, the tokens of an uninterrupted run.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate, stream
from pdserve.cluster import Cluster, Service
from tests.helpers import POEM, assert_nothing_held, decoding_worker, start_cluster


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
