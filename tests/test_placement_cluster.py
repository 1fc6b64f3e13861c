"""Placement on a real cluster of the default model: the workers measure and report their costs, each request says
where it ran and why, and a request that asks to be refused rather than served late is refused before anything
starts, with the reason and a Retry-After; bad service levels are refused by name."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from serving.metrics import scrape
from tests.helpers import assert_nothing_held, start_cluster, worker_infos

pytestmark = pytest.mark.slow

DOCUMENT = "The clockmaker wound every clock in the village before dawn, one after another. " * 60  # ~1,000 tokens


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path) -> Iterator[Cluster]:
    cluster = start_cluster(default_model_dir, dtype="bfloat16", gateway_args=("--placement=model",))
    yield cluster
    cluster.stop()


def _post(cluster: Cluster, body: dict) -> tuple[int, dict[str, str], dict]:
    host, port = cluster.gateway.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps({"model": "smollm2-135m-instruct", **body}),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def test_workers_report_measured_costs_and_each_request_says_where_it_ran_and_why(cluster: Cluster) -> None:
    for info in worker_infos(cluster):
        costs = info.costs
        assert costs.passes >= 3, info  # the start-up calibration at least
        assert len(costs.pass_coefficients) == 3 and all(c >= 0 for c in costs.pass_coefficients)
        assert costs.pass_coefficients[1] > 0  # a token costs time
        assert costs.chunk_tokens > 0
    completion = generate(cluster.gateway.address, timeout=120, prompt="The capital of France is", max_tokens=4)
    timing = completion.timing
    assert timing is not None
    # both choices were weighed, and the one predicted sooner (first in the reason) was taken
    assert "prefill 127.0.0.1" in timing.placement_reason and "colocated 127.0.0.1" in timing.placement_reason
    assert timing.placement_reason.startswith(timing.placement)
    assert timing.predicted_ttft_ms > 0 and timing.placed_ttft_ms > 0
    samples = scrape(cluster.gateway.metrics)
    assert samples[f'pdserve_placements_total{{placement="{timing.placement}"}}'] == 1
    assert samples[f'pdserve_placement_ttft_error_ratio_count{{placement="{timing.placement}"}}'] == 1
    assert_nothing_held(cluster)


def test_a_request_predicted_to_miss_its_ttft_is_refused_before_it_starts(cluster: Cluster) -> None:
    refused_before = scrape(cluster.gateway.metrics).get("pdserve_rejections_total", 0)
    # ~1,000 tokens cannot be prefilled in 50 ms on a CPU: predicted late, refused at once, with the reason
    status, headers, body = _post(cluster, {"prompt": DOCUMENT, "max_tokens": 4,
                                            "slo": {"ttft_ms": 50, "refuse_late": True}})
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1
    message = body["error"]["message"]
    assert "predicted" in message and "slo.ttft_ms of 50" in message and "prefill 127.0.0.1" in message
    with grpc.insecure_channel(cluster.gateway.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                prompt=DOCUMENT, max_tokens=4, slo=gateway_pb2.Slo(ttft_ms=50, refuse_late=True)), timeout=120))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(refused.value.trailing_metadata() or ())["retry-after-ms"]) >= 1
    assert scrape(cluster.gateway.metrics)["pdserve_rejections_total"] == refused_before + 2
    # without refuse_late it is served, late
    status, _, body = _post(cluster, {"prompt": DOCUMENT, "max_tokens": 2, "slo": {"ttft_ms": 50}})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert_nothing_held(cluster)


@pytest.mark.parametrize("slo, named", [
    ("fast", "slo is an object"),
    ({"ttft_ms": -1}, "slo.ttft_ms must be a whole number"),
    ({"tpot_ms": 1.5}, "slo.tpot_ms must be a whole number"),
    ({"tpot_ms": 70_000}, "slo.tpot_ms 70000: must be at most 60000"),
    ({"ttft_ms": 4_000_000}, "slo.ttft_ms 4000000: must be at most 3600000"),
    ({"refuse_late": True}, "slo.refuse_late needs slo.ttft_ms"),
    ({"refuse_late": "yes", "ttft_ms": 5}, "slo.refuse_late must be a boolean"),
    ({"priority": 1}, "slo is an object"),
])
def test_bad_service_levels_are_refused_by_name(cluster: Cluster, slo: object, named: str) -> None:
    status, _, body = _post(cluster, {"prompt": "Hi", "max_tokens": 2, "slo": slo})
    assert status == 400 and named in body["error"]["message"], body


@pytest.mark.parametrize("slo, named", [
    (gateway_pb2.Slo(tpot_ms=60_001), "slo.tpot_ms 60001"),
    (gateway_pb2.Slo(ttft_ms=3_600_001), "slo.ttft_ms 3600001"),
    (gateway_pb2.Slo(refuse_late=True), "slo.refuse_late needs slo.ttft_ms"),
])
def test_bad_service_levels_are_invalid_argument_over_grpc(cluster: Cluster, slo: gateway_pb2.Slo,
                                                           named: str) -> None:
    with grpc.insecure_channel(cluster.gateway.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=2, slo=slo), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (refused.value.details() or "")


def test_a_decode_worker_refuses_a_time_per_token_target_past_a_minute(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.decode[0].address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.DecodeRequest(
                request_id="r", prompt_tokens=3, max_tokens=2, tpot_target_ms=60_001), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tpot_target_ms 60001" in (refused.value.details() or "")
