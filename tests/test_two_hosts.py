"""Two hosts on one machine: the gateway and prefill in this network namespace, decode in another, joined by a
veth pair. Decode lends no shared memory (`--no-kv-shm`, as across real hosts: namespaces still share /dev/shm),
so the KV crosses the link over gRPC, and the workers authenticate with a shared token, as any worker off
loopback must. The tokens equal a single-host run's. Then the fault proxy's faults on that link (latency, a
throttled link, a reset connection): every request ends with its tokens or a clear status, and decode ends up
holding nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.client import generate, stream
from pdserve.cluster import Cluster, Service, spawn_service, stop_all, wait_healthy, wait_ready
from pdserve.faults import FaultProxy
from tests.helpers import assert_nothing_held, start_cluster

NAMESPACE = f"pds{os.getpid() % 100000}"
HOST_IP, PEER_IP = "10.231.7.1", "10.231.7.2"  # this namespace's end of the link, decode's end
TOKEN = "two-hosts-test-token"
PROMPTS = ["Tell me about the sea", "A story about a fox and a crow", "List three colours", "Why is the sky blue?"]
REQUEST: dict[str, Any] = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def peer_namespace() -> Iterator[str]:
    """A network namespace joined to this one by a veth pair: HOST_IP here, PEER_IP there."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    here, there = f"vh{NAMESPACE}", f"vp{NAMESPACE}"
    subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True, timeout=10)  # a leftover of a killed run
    try:
        _ip("netns", "add", NAMESPACE)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", NAMESPACE)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", NAMESPACE, "addr", "add", f"{PEER_IP}/30", "dev", there)
        _ip("-n", NAMESPACE, "link", "set", there, "up")
        _ip("-n", NAMESPACE, "link", "set", "lo", "up")
        yield NAMESPACE
    finally:
        subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True, timeout=10)  # takes the veth pair
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def two_hosts(tiny_model_dir: Path, peer_namespace: str) -> Iterator[tuple[Cluster, FaultProxy]]:
    """The cluster across the link; the gateway reaches decode (its calls and prefill's KV) through a proxy."""
    common = ["--model", str(tiny_model_dir), "--dtype", "bfloat16", "--threads", "1", "--port", "0"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDSERVE_WORKER_TOKEN", TOKEN)  # every process started here, and this one's own channels
        decode = Service("decode", subprocess.Popen(
            ["ip", "netns", "exec", peer_namespace, sys.executable, "-m", "pdserve.launch", str(os.getpid()), "",
             "decode_service", "--host", PEER_IP, "--no-kv-shm", "--lease=5", *common],
            stdout=subprocess.PIPE, text=True))
        services = [decode, spawn_service("prefill", "prefill_service", ["--host", "127.0.0.1", *common])]
        proxy = None
        try:
            wait_ready(services, 120)
            assert decode.address.startswith(PEER_IP + ":")
            proxy = FaultProxy(decode.address)
            gateway = spawn_service("gateway", "gateway", [
                "--host", "127.0.0.1", "--port", "0", "--model", str(tiny_model_dir), "--http-port", "-1",
                "--colocate-below", "0", "--placement=threshold",  # every prompt's KV crosses the link
                f"--prefill={services[1].address}", f"--decode={proxy.address}"])
            services.append(gateway)
            wait_ready([gateway], 60)
            cluster = Cluster(gateway, [services[1]], [decode])
            for service in cluster.services:
                wait_healthy(service.address, 30, expect=service.role)
            yield cluster, proxy
        finally:
            stop_all(services, grace_s=5)
            if proxy is not None:
                proxy.close()


@pytest.fixture(scope="module")
def single_host_tokens(tiny_model_dir: Path) -> list[list[int]]:
    cluster = start_cluster(tiny_model_dir, colocate_below=0, dtype="bfloat16")
    try:
        return [generate(cluster.gateway.address, 60, prompt=p, **REQUEST).token_ids for p in PROMPTS]
    finally:
        cluster.stop()


def test_the_kv_crosses_the_link_over_grpc_and_the_tokens_equal_a_single_host_run(
    two_hosts: tuple[Cluster, FaultProxy], single_host_tokens: list[list[int]],
) -> None:
    cluster, proxy = two_hosts
    before, kv_bytes = proxy.forwarded, 0
    for prompt, expected in zip(PROMPTS, single_host_tokens, strict=True):
        completion = generate(cluster.gateway.address, 60, prompt=prompt, **REQUEST)
        assert completion.token_ids == expected and completion.finish_reason == "length"
        assert completion.timing is not None
        assert completion.timing.kv_transport == "grpc" and completion.timing.kv_bytes > 0
        kv_bytes += completion.timing.kv_bytes
    assert proxy.forwarded - before > kv_bytes  # the KV itself crossed the link, beside the gateway's calls
    assert_nothing_held(cluster)


def test_latency_and_a_throttled_link_slow_the_requests_but_change_no_token(
    two_hosts: tuple[Cluster, FaultProxy], single_host_tokens: list[list[int]],
) -> None:
    cluster, proxy = two_hosts
    proxy.delay_s, proxy.throttle_bps = 0.02, 2e6  # 20 ms each way per chunk, 2 MB/s
    try:
        started = time.monotonic()
        completion = generate(cluster.gateway.address, 60, prompt=PROMPTS[0], **REQUEST)
        assert completion.token_ids == single_host_tokens[0]
        # at least the reservation's way back, the KV's way there and the tokens' way back crossed the slowed link
        assert time.monotonic() - started > 3 * 0.02
    finally:
        proxy.restore()
    assert_nothing_held(cluster)


def test_a_link_reset_mid_stream_ends_every_request_with_its_tokens_or_a_clear_status(
    two_hosts: tuple[Cluster, FaultProxy], single_host_tokens: list[list[int]],
) -> None:
    cluster, proxy = two_hosts
    fields = {**REQUEST, "max_tokens": 400}
    outcomes: list[object] = [None] * len(PROMPTS)
    migrations = [0] * len(PROMPTS)
    streaming = [threading.Event() for _ in PROMPTS]

    def run(i: int) -> None:
        tokens: list[int] = []
        try:
            for response in stream(cluster.gateway.address, 90, prompt=PROMPTS[i], **fields):
                tokens += response.token_ids
                streaming[i].set()
                if response.finish_reason:
                    migrations[i] = response.timing.migrations
            outcomes[i] = tokens
        except grpc.RpcError as exc:
            outcomes[i] = exc.code()  # type: ignore[attr-defined]
        finally:
            streaming[i].set()

    proxy.delay_s = 0.005  # the streams last long enough to be cut
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for event in streaming:
        assert event.wait(30)
    proxy.reset()  # every connection across the link, mid-stream: RST on both sides
    proxy.restore()
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads)
    for i, outcome in enumerate(outcomes):
        # resumed (a migration re-prefills on the one decode worker) or ended with a retryable status
        assert outcome == grpc.StatusCode.UNAVAILABLE or (isinstance(outcome, list) and len(outcome) == 400), (
            i, outcome)
    assert sum(migrations) + outcomes.count(grpc.StatusCode.UNAVAILABLE) >= 1  # the reset did cut streams
    # the link works again, and decode let everything go
    assert generate(cluster.gateway.address, 60, prompt=PROMPTS[0], **REQUEST).token_ids == single_host_tokens[0]
    assert_nothing_held(cluster, within_s=10)
