"""Every service's Prometheus /metrics: the live gauges follow a request and return to zero; counters count."""

from __future__ import annotations

import time

from pdserve.client import generate, stream
from pdserve.cluster import Cluster, Service
from pdserve.metrics import scrape
from tests.conftest import assert_nothing_held

LIVE = {"gateway": ["pdserve_live_requests"], "prefill": ["pdserve_live_prefills", "pdserve_queued_tokens"],
        "decode": ["pdserve_live_reservations", "pdserve_live_sequences", "pdserve_live_kv_bytes",
                   "pdserve_live_buffer_bytes"]}


def _services(cluster: Cluster) -> list[tuple[str, Service]]:
    return [("gateway", cluster.gateway), *(("prefill", s) for s in cluster.prefill),
            *(("decode", s) for s in cluster.decode)]


def _live(cluster: Cluster) -> dict[str, float]:
    totals: dict[str, float] = {}
    for role, service in _services(cluster):
        samples = scrape(service.metrics)
        for name in LIVE[role]:
            totals[name] = totals.get(name, 0) + samples[name]
    return totals


def test_live_gauges_follow_a_stream_and_return_to_zero_when_it_is_cancelled(tiny_cluster: Cluster) -> None:
    assert all(service.metrics for _, service in _services(tiny_cluster))  # announced in the cluster's JSON line
    assert set(_live(tiny_cluster).values()) == {0}
    before = {role: scrape(service.metrics) for role, service in _services(tiny_cluster)[:1]}["gateway"]
    responses = stream(tiny_cluster.gateway.address, 60, prompt="Tell me a long story", max_tokens=400,
                       ignore_eos=True)
    next(responses)
    next(responses)
    live = _live(tiny_cluster)
    assert live["pdserve_live_requests"] == 1 and live["pdserve_live_sequences"] == 1
    assert live["pdserve_live_kv_bytes"] > 0
    responses.close()  # type: ignore[attr-defined]  # cancels the request
    deadline = time.monotonic() + 1.0
    while set(_live(tiny_cluster).values()) != {0}:
        assert time.monotonic() < deadline, _live(tiny_cluster)
        time.sleep(0.02)
    after = scrape(tiny_cluster.gateway.metrics)
    assert after["pdserve_requests_total"] == before["pdserve_requests_total"] + 1
    assert after["pdserve_cancellations_total"] == before["pdserve_cancellations_total"] + 1
    decode_cancellations = sum(scrape(s.metrics)["pdserve_cancellations_total"] for s in tiny_cluster.decode)
    assert decode_cancellations >= 1
    assert_nothing_held(tiny_cluster)


def test_latency_histograms_and_token_counters_move_when_requests_run(tiny_cluster: Cluster) -> None:
    before = scrape(tiny_cluster.gateway.metrics)
    completion = generate(tiny_cluster.gateway.address, timeout=60, prompt="Hi there", max_tokens=6, ignore_eos=True)
    after = scrape(tiny_cluster.gateway.metrics)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("pdserve_time_to_first_token_seconds_count") == 1
    assert moved("pdserve_e2e_request_latency_seconds_count") == 1
    assert moved("pdserve_queue_time_seconds_count") == 1
    assert moved("pdserve_inter_token_latency_seconds_count") == 5  # 6 tokens, 5 gaps
    assert moved("pdserve_e2e_request_latency_seconds_sum") >= moved("pdserve_time_to_first_token_seconds_sum") > 0
    assert moved("pdserve_generation_tokens_total") == 6
    assert moved("pdserve_prompt_tokens_total") == completion.usage.prompt_tokens
