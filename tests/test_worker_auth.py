"""Workers without TLS: a shared worker token authenticates the calls between services, and a worker with
neither TLS nor a token listens on loopback only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster import Cluster
from protos import decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2
from tests.helpers import assert_nothing_held, reserve, start_cluster

TOKEN = "s3cret-worker-token"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def tokened(tiny_model_dir: Path) -> Iterator[Cluster]:
    """A cluster whose processes share a worker token (from the environment they inherit); the KV goes over
    gRPC to decode's own KV port, so that hop is authenticated too. This process holds the token as well, so
    the tests' own channels (cluster.channel) carry it."""
    os.environ["PDSERVE_WORKER_TOKEN"] = TOKEN
    try:
        cluster = start_cluster(tiny_model_dir, decode_args=("--kv-port=0",), prefill_args=("--no-kv-shm",))
    except BaseException:
        del os.environ["PDSERVE_WORKER_TOKEN"]
        raise
    yield cluster
    cluster.stop()
    del os.environ["PDSERVE_WORKER_TOKEN"]


def test_the_full_request_path_carries_the_token(tokened: Cluster) -> None:
    with grpc.insecure_channel(tokened.gateway.address) as chan:  # users reach the gateway without the token
        responses = list(gateway_pb2_grpc.GatewayStub(chan).Generate(
            gateway_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=4, ignore_eos=True), timeout=60))
    assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 4
    assert responses[-1].timing.kv_transport == "grpc"  # prefill -> decode's KV port, with the token
    assert_nothing_held(tokened)


@pytest.mark.parametrize("sent", [None, "wrong-token"], ids=["no token", "wrong token"])
def test_a_caller_without_the_token_is_refused_by_every_worker_call(tokened: Cluster, sent: str | None) -> None:
    metadata = None if sent is None else [("x-pdserve-worker-token", sent)]
    decode, prefill = tokened.decode[0], tokened.prefill[0]
    with grpc.insecure_channel(decode.address) as d, grpc.insecure_channel(prefill.address) as p, \
            grpc.insecure_channel(decode.kv) as k:
        calls = {
            "reserve": lambda: decode_pb2_grpc.DecodeStub(d).Generate(
                decode_pb2.DecodeRequest(request_id="x", prompt_tokens=3, max_tokens=2),
                timeout=10, metadata=metadata).next(),
            "decode info": lambda: decode_pb2_grpc.DecodeStub(d).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=10,
                                                                         metadata=metadata),
            "prefill": lambda: prefill_pb2_grpc.PrefillStub(p).Prefill(prefill_pb2.PrefillRequest(
                request_id="x", token_ids=[1, 2, 3], decode_address=decode.address, reservation_token="t"),
                timeout=10, metadata=metadata).next(),
            "kv stream": lambda: decode_pb2_grpc.DecodeStub(k).TransferKV(iter([]), timeout=10, metadata=metadata),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == UNAUTHENTICATED, name  # type: ignore[attr-defined]
            assert "worker token" in (refused.value.details() or ""), name  # type: ignore[attr-defined]
        # Probes need no token: the health check answers.
        health = health_pb2_grpc.HealthStub(d).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with tokened.channel(decode) as chan:  # with the token (this process holds it): served
        call, token = reserve(decode_pb2_grpc.DecodeStub(chan), "with-the-token")
        assert token
        call.cancel()
    assert_nothing_held(tokened)


def test_a_worker_refuses_to_listen_beyond_loopback_with_neither_tls_nor_a_token(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_WORKER_TOKEN")}
    started = subprocess.run([sys.executable, "-m", "decode_service", "--model", str(tiny_model_dir), "--dtype",
                              "float32", "--host", "0.0.0.0", "--port", "0", "--max-seqs", "2"],
                             env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 1
    assert "unauthenticated" in started.stderr and "PDSERVE_WORKER_TOKEN" in started.stderr


def test_an_empty_worker_token_file_stops_a_worker_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_WORKER_TOKEN")},
           "PDSERVE_WORKER_TOKEN_FILE": str(empty)}
    started = subprocess.run([sys.executable, "-m", "prefill_service", "--model", str(tiny_model_dir), "--dtype",
                              "float32", "--port", "0"], env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 1 and "holds no token" in started.stderr
