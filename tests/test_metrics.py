"""Every service's Prometheus /metrics: the live gauges follow a request and return to zero; counters count."""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import generate, stream
from pdserve.cluster import Cluster
from protos import decode_pb2_grpc, kv_transfer_pb2
from serving.metrics import scrape
from tests.helpers import assert_nothing_held, assert_nothing_live, live_gauges, services_by_role, wait_until


def test_live_gauges_follow_a_stream_and_return_to_zero_when_it_is_cancelled(tiny_cluster: Cluster) -> None:
    # 1. Every service announced its /metrics, and nothing is live.
    assert all(service.metrics for _, service in services_by_role(tiny_cluster))  # in the cluster's JSON line
    assert set(live_gauges(tiny_cluster).values()) == {0}
    before = scrape(tiny_cluster.gateway.metrics)
    # 2. A long stream runs: one request at the gateway, one sequence decoding, its KV held.
    responses = stream(tiny_cluster.gateway.address, 60, prompt="Tell me a long story", max_tokens=400,
                       ignore_eos=True)
    next(responses)
    next(responses)
    live = live_gauges(tiny_cluster)
    assert live["pdserve_live_requests"] == 1 and live["pdserve_live_sequences"] == 1
    assert live["pdserve_live_kv_bytes"] > 0
    # 3. Cancel it: the counters count it once, at the gateway and on decode.
    responses.close()  # type: ignore[attr-defined]
    assert_nothing_live(tiny_cluster, within_s=10)
    after = scrape(tiny_cluster.gateway.metrics)
    assert after["pdserve_requests_total"] == before["pdserve_requests_total"] + 1
    assert after["pdserve_cancellations_total"] == before["pdserve_cancellations_total"] + 1
    decode_cancellations = sum(scrape(s.metrics)["pdserve_cancellations_total"] for s in tiny_cluster.decode)
    assert decode_cancellations >= 1
    # 4. Leak check, through GetInfo as well as the gauges.
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


def test_tokens_that_reach_the_client_with_the_first_one_still_count_their_gaps(tiny_cluster: Cluster) -> None:
    # A stop string that the whole output begins holds every token back until the last flushes them together.
    # Six tokens are still five gaps: the five that came with the first are gaps of zero.
    request = dict(prompt="Hi there", max_tokens=6, ignore_eos=True, temperature=0)
    plain = generate(tiny_cluster.gateway.address, timeout=60, **request)
    before = scrape(tiny_cluster.gateway.metrics)
    responses = list(stream(tiny_cluster.gateway.address, 60, **request, stop=[plain.text + "\u2603 never generated"]))
    after = scrape(tiny_cluster.gateway.metrics)
    assert [list(r.token_ids) for r in responses] == [list(plain.token_ids)]  # held back, then released together
    gaps = "pdserve_inter_token_latency_seconds_count"
    assert after[gaps] - before[gaps] == 5
    assert after["pdserve_inter_token_latency_seconds_sum"] == before["pdserve_inter_token_latency_seconds_sum"]
    assert after["pdserve_generation_tokens_total"] - before["pdserve_generation_tokens_total"] == 6


def test_worker_histograms_and_kv_transfer_counters_move_by_path(tiny_cluster: Cluster) -> None:
    def totals() -> dict[str, float]:
        found: dict[str, float] = {}
        for role, service in services_by_role(tiny_cluster)[1:]:
            for name, value in scrape(service.metrics).items():
                found[f"{role} {name}"] = found.get(f"{role} {name}", 0) + value
        return found

    before = totals()
    completion = generate(tiny_cluster.gateway.address, timeout=60, prompt="Hi there", max_tokens=6, ignore_eos=True)
    shm = '{path="shm"}'  # prefill and decode share this host: the KV moved through shared memory
    decoded = "decode pdserve_request_decode_time_seconds_count"  # observed as the worker lets the request go
    after = wait_until(lambda: (found := totals())[decoded] > before.get(decoded, 0) and found,
                       "decode to observe the request's decode time")

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert moved("prefill pdserve_request_queue_time_seconds_count") == 1
    assert moved("prefill pdserve_request_prefill_time_seconds_count") == 1
    assert moved("prefill pdserve_prompt_tokens_total") == completion.usage.prompt_tokens
    assert moved("prefill pdserve_prefix_cache_queries_total") == completion.usage.prompt_tokens
    assert moved("prefill pdserve_prefill_computed_tokens_total") == (completion.usage.prompt_tokens
                                                                      - completion.usage.cached_tokens)
    # the pool holds at least the blocks cached, and no more than the budget
    assert after["prefill pdserve_prefix_cache_bytes"] <= after["prefill pdserve_prefix_cache_pool_bytes"]
    assert after["prefill pdserve_prefix_cache_pool_bytes"] <= 512 << 20
    assert moved(f"prefill pdserve_kv_transfer_seconds_count{shm}") == 1
    sent = moved(f"prefill pdserve_kv_transfer_bytes_total{shm}")
    assert sent > 0 and moved(f"decode pdserve_kv_transfer_bytes_total{shm}") == sent
    assert moved(f"decode pdserve_kv_transfer_seconds_count{shm}") == 1
    assert moved("decode pdserve_decode_step_seconds_count") == 5  # 6 tokens: the first from prefill, 5 steps
    assert moved("decode pdserve_decode_batch_size_sum") == 5  # alone in every step
    # 5 steps back to back: 4 intervals, each from one step's start to the next one's
    assert moved("decode pdserve_decode_interval_seconds_count") == 4
    assert moved("decode pdserve_decode_interval_seconds_sum") > 0
    assert moved("decode pdserve_generation_tokens_total") == 5
    assert moved("decode pdserve_request_decode_time_seconds_count") == 1
    assert not any(moved(name) for name in after if "kv_transfer_failures" in name)
    assert after["decode pdserve_kv_cache_usage_perc"] == 0 and after["decode pdserve_num_requests_running"] == 0


def test_a_refused_kv_transfer_counts_as_a_failure(tiny_cluster: Cluster) -> None:
    worker = tiny_cluster.decode[0]
    name = 'pdserve_kv_transfer_failures_total{path="grpc"}'
    before = scrape(worker.metrics).get(name, 0)
    forged = kv_transfer_pb2.KVTransfer(header=kv_transfer_pb2.KVHeader(request_id="nobody",
                                                                         reservation_token="forged"))
    with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError) as refused:
        decode_pb2_grpc.DecodeStub(channel).TransferKV(iter([forged]), timeout=10)
    assert refused.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    # Counted as the handler unwinds, which may be just after the status reached this client.
    wait_until(lambda: scrape(worker.metrics).get(name, 0) > before, "the failure to be counted")
    assert scrape(worker.metrics)[name] == before + 1
    assert_nothing_held(tiny_cluster)


def test_every_service_s_metrics_parse_as_prometheus_text(tiny_cluster: Cluster) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    for role, service in services_by_role(tiny_cluster):
        with urllib.request.urlopen(f"http://{service.metrics}/metrics", timeout=5) as response:
            families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
        histograms = [name for name, family in families.items() if family.type == "histogram"]
        assert histograms, role  # every service has latency histograms
        for name in histograms:  # per label set, cumulative buckets ending in +Inf, as Prometheus requires
            series: dict[tuple, list] = {}
            for sample in families[name].samples:
                if sample.name.endswith("_bucket"):
                    key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                    series.setdefault(key, []).append(sample)
            for buckets in series.values():
                assert buckets[-1].labels["le"] == "+Inf"
                assert all(a.value <= b.value for a, b in zip(buckets, buckets[1:]))
