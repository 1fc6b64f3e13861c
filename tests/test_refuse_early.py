"""A request the gateway admits is not failed later for the server's own slowness, and a frozen worker is still
found, with real processes.

- Decode's lease guards against a dead or frozen prefill worker, not a slow one: a prompt that waits in a long
  prefill queue past the lease still completes (prefill renews it), and a SIGSTOPped prefill worker still lets it
  end, as a retry and then UNAVAILABLE, never DEADLINE_EXCEEDED before the client's own deadline.
- Colocation is decided per attempt: a colocated stream that migrates after its prompt grew past
  --colocate-below is re-prefilled by a prefill worker, not by a decode worker.
- A colocated prompt's wait for its first token is bounded: heartbeats keep a long prefill going, and a decode
  worker SIGSTOPped while it prefills is left for another.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.client import Completion, generate, stream
from pdserve.cluster import Cluster
from serving.metrics import scrape
from tests.helpers import assert_nothing_held, decoding_worker, start_cluster

LEASE_S = 1.0
LONG_PROMPT = "count " * 440  # ~440 tokens: on the 200-layer tiny model, in 16-token chunks, about a second a prompt
CHUNKED = ("--prefill-chunk=16", "--prefill-batch-tokens=16")


def _all(address: str, count: int, prompt: str = LONG_PROMPT, max_tokens: int = 4) -> list[Completion]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: generate(address, timeout=120, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0.0, request_id=f"r{i}"), range(count)))


@pytest.fixture(scope="module")
def slow_prefill(deep_tiny_model_dir: Path) -> Iterator[Cluster]:
    """One prefill worker that takes about a second a long prompt, and a decode worker whose lease is 1 s."""
    cluster = start_cluster(deep_tiny_model_dir, prefill=1, decode=1, prefill_args=(*CHUNKED, "--prefix-cache-mb=0"),
                            decode_args=(f"--lease={LEASE_S}",))
    yield cluster
    cluster.stop()


def test_prompts_queued_in_prefill_past_decode_s_lease_all_complete_without_a_retry(slow_prefill: Cluster) -> None:
    # 1. Eight long prompts at once: all but the first wait in prefill's queue, the last ones many leases long.
    completions = _all(slow_prefill.gateway.address, 8)
    waits = sorted(c.timing.prefill_queue_ms for c in completions if c.timing is not None)
    assert waits[-1] > 3 * LEASE_S * 1000, f"the queue never outlasted the lease: {waits} ms"
    # 2. Every one finished, none was failed and retried for the queue's length.
    assert all(c.finish_reason for c in completions)
    assert [c.timing.retries for c in completions if c.timing is not None] == [0] * 8
    assert_nothing_held(slow_prefill, within_s=10)


def test_a_frozen_prefill_worker_ends_as_unavailable_never_deadline_exceeded(slow_prefill: Cluster) -> None:
    prefill = slow_prefill.prefill[0].process
    prefill.send_signal(signal.SIGSTOP)  # it renews nothing now: each attempt's lease runs out
    started = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as failed:
            generate(slow_prefill.gateway.address, timeout=60, prompt="Hello", max_tokens=4)
    finally:
        prefill.send_signal(signal.SIGCONT)
    # the server's own limit ended it, long before the client's 60 s deadline, and said so
    assert time.monotonic() - started < 30
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    assert "lease" in (failed.value.details() or "")
    assert_nothing_held(slow_prefill, within_s=10)
    assert generate(slow_prefill.gateway.address, timeout=60, prompt="Hello", max_tokens=4).finish_reason


def test_a_migrated_colocated_stream_whose_prompt_grew_past_colocate_below_goes_to_prefill(
    tiny_model_dir: Path,
) -> None:
    # --colocate-queued=0: every prompt under 16 tokens is colocated, whatever prefill's load
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=2, colocate_below=16,
                            gateway_args=("--colocate-queued=0",))
    try:
        # 1. A short prompt, colocated; its decode worker is killed once 30 tokens were sent.
        final = None
        for i, response in enumerate(stream(cluster.gateway.address, timeout=60, prompt="Hi", max_tokens=300,
                                            temperature=0.0, ignore_eos=True)):
            if i == 30:
                killed = decoding_worker(cluster)
                killed.process.send_signal(signal.SIGKILL)
                killed.process.wait(timeout=10)
                cluster.decode.remove(killed)
            if response.finish_reason:
                final = response
        # 2. The stream migrated with a prompt past 16 tokens: prefill's worker prefilled it, and the KV moved.
        assert final is not None and final.timing.migrations == 1
        assert final.usage.completion_tokens == 300
        assert final.timing.kv_transport in ("shm", "grpc"), final.timing.kv_transport
        assert scrape(cluster.prefill[0].metrics)["pdserve_prompt_tokens_total"] > 16
        assert_nothing_held(cluster, within_s=10)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def colocated_only(deep_tiny_model_dir: Path) -> Iterator[Cluster]:
    """No prefill workers: the decode workers prefill every prompt, in 16-token chunks (about a second a long
    one). The idle timeout is 0.5 s, and keepalive would take two minutes to find a frozen worker."""
    cluster = start_cluster(deep_tiny_model_dir, prefill=0, decode=2, decode_args=CHUNKED,
                            gateway_args=("--idle-timeout=0.5", "--keepalive=60", "--keepalive-timeout=60"))
    yield cluster
    cluster.stop()


def test_colocated_prefills_longer_than_the_idle_timeout_are_not_cut(colocated_only: Cluster) -> None:
    # eight long prompts over two workers: each waits for the ones before it on its worker, then prefills
    completions = _all(colocated_only.gateway.address, 8)
    ttfts = sorted(c.timing.ttft_ms for c in completions if c.timing is not None)
    assert ttfts[-1] > 3 * 500, f"no prefill outlasted the idle timeout: {ttfts} ms"
    assert all(c.finish_reason for c in completions)
    assert [(c.timing.retries, c.timing.kv_transport) for c in completions if c.timing is not None] == [
        (0, "colocated")] * 8
    assert_nothing_held(colocated_only, within_s=10, prefill=False)


def test_a_decode_worker_frozen_while_it_prefills_a_colocated_prompt_is_left_for_another(
    colocated_only: Cluster,
) -> None:
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, colocated_only.gateway.address, timeout=30, prompt=LONG_PROMPT,
                              max_tokens=4, temperature=0.0)
        # 1. Freeze the worker while the prompt is in its prefill (it holds the sequence, no token sent yet).
        frozen = decoding_worker(colocated_only)  # (a colocated prompt counts as a sequence while it prefills)
        frozen.process.send_signal(signal.SIGSTOP)
        try:
            # 2. Its heartbeats stop: the gateway retries on the other worker, well within the client's deadline.
            completion = pending.result(timeout=60)
        finally:
            frozen.process.send_signal(signal.SIGCONT)
    assert completion.finish_reason and completion.timing is not None
    assert completion.timing.retries == 1 and completion.timing.kv_transport == "colocated"
    assert_nothing_held(colocated_only, within_s=10, prefill=False)
