"""Mutual TLS across the cluster: the full path works with certificates, and everything else is refused.

Certificates come from deploy/make-certs.sh (the development CA script), a second run of which plays a rogue CA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.cluster import Cluster
from protos import decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from serving.tls import TLS, channel
from tests.helpers import assert_nothing_held, kv_stream, reserve, start_cluster

ROOT = Path(__file__).resolve().parent.parent
LEASE_S = 2.0


def _certs(directory: Path) -> Path:
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(directory)], check=True,
                   capture_output=True, timeout=60)
    return directory


def _identity(certs: Path, role: str) -> TLS:
    return TLS.of(str(certs), role)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secured(tiny_model_dir: Path, certs: Path) -> Iterator[Cluster]:
    # The KV goes over gRPC (no shared memory), to decode's own KV port: every byte crosses mutual TLS.
    cluster = start_cluster(tiny_model_dir, decode_args=(f"--lease={LEASE_S}", "--kv-port=0"),
                            prefill_args=("--no-kv-shm",), tls_dir=str(certs))
    yield cluster
    cluster.stop()


def _generate(cluster: Cluster, identity: TLS | None, **fields: object) -> list[gateway_pb2.GenerateResponse]:
    with channel(cluster.gateway.address, identity, expect="gateway") as chan:
        return list(gateway_pb2_grpc.GatewayStub(chan).Generate(gateway_pb2.GenerateRequest(**fields), timeout=60))


def test_the_full_request_path_works_under_mutual_tls(secured: Cluster, certs: Path) -> None:
    responses = _generate(secured, _identity(certs, "client"), prompt="The capital of France is", max_tokens=5,
                          ignore_eos=True)
    assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 5
    timing = responses[-1].timing
    assert timing.kv_bytes > 0 and timing.kv_transport == "grpc"  # prefill -> decode's KV port, over mutual TLS
    assert_nothing_held(secured)


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_a_plain_text_client_is_refused_by_every_service(secured: Cluster, role: str) -> None:
    service = {"gateway": secured.gateway, "prefill": secured.prefill[0], "decode": secured.decode[0]}[role]
    with grpc.insecure_channel(service.address) as plain, pytest.raises(grpc.RpcError) as refused:
        gateway_pb2_grpc.GatewayStub(plain).Generate(gateway_pb2.GenerateRequest(prompt="Hi"), timeout=10).next()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_a_client_whose_certificate_another_ca_signed_is_refused(secured: Cluster, certs: Path,
                                                                 tmp_path: Path) -> None:
    rogue = _certs(tmp_path / "rogue")
    # It trusts the real CA (so it would accept the gateway), but presents a certificate the gateway cannot trust.
    impostor = TLS(str(rogue / "client.pem"), str(rogue / "client-key.pem"), str(certs / "ca.pem"))
    with pytest.raises(grpc.RpcError) as refused:
        _generate(secured, impostor, prompt="Hi", max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert _generate(secured, _identity(certs, "client"), prompt="Hi", max_tokens=2)[-1].finish_reason


def test_roles_authorise_the_calls_between_services(secured: Cluster, certs: Path) -> None:
    client, gateway = _identity(certs, "client"), _identity(certs, "gateway")
    decode_address, kv_address, prefill_address = (secured.decode[0].address, secured.decode[0].kv,
                                                   secured.prefill[0].address)
    with channel(decode_address, client, expect="decode") as chan, pytest.raises(grpc.RpcError) as reserving:
        reserve(decode_pb2_grpc.DecodeStub(chan), "not-a-gateway")  # only a gateway reserves
    assert reserving.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    with channel(prefill_address, client, expect="prefill") as chan, pytest.raises(grpc.RpcError) as prefill:
        prefill_pb2_grpc.PrefillStub(chan).Prefill(prefill_pb2.PrefillRequest(
            request_id="x", token_ids=[1, 2, 3], decode_address=decode_address, reservation_token="t"),
            timeout=10).next()
    assert prefill.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    with channel(decode_address, gateway, expect="decode") as g, channel(kv_address, gateway, expect="decode") as k:
        stub = decode_pb2_grpc.DecodeStub(g)
        call, token = reserve(stub, "kv-from-a-gateway")
        with pytest.raises(grpc.RpcError) as pushed:  # a gateway holding a real token still may not push KV
            decode_pb2_grpc.DecodeStub(k).TransferKV(iter(kv_stream(stub, "kv-from-a-gateway", token)), timeout=10)
        assert pushed.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        call.cancel()
    assert_nothing_held(secured)


def test_decode_serves_the_kv_stream_on_its_own_port_only(secured: Cluster, certs: Path) -> None:
    decode = secured.decode[0]
    assert decode.kv and decode.kv != decode.address
    prefill = _identity(certs, "prefill")
    with channel(decode.address, prefill, expect="decode") as control, pytest.raises(grpc.RpcError) as on_control:
        decode_pb2_grpc.DecodeStub(control).TransferKV(iter([]), timeout=10)
    assert on_control.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
    with channel(decode.kv, _identity(certs, "gateway"), expect="decode") as kv, pytest.raises(grpc.RpcError) as on_kv:
        reserve(decode_pb2_grpc.DecodeStub(kv), "reserve-on-the-kv-port")
    assert on_kv.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]


def test_forged_reused_and_expired_reservation_tokens_are_refused_and_nothing_is_held(secured: Cluster,
                                                                                      certs: Path) -> None:
    decode = secured.decode[0]
    with channel(decode.address, _identity(certs, "gateway"), expect="decode") as g, \
            channel(decode.kv, _identity(certs, "prefill"), expect="decode") as p:
        gateway_side, prefill_side = decode_pb2_grpc.DecodeStub(g), decode_pb2_grpc.DecodeStub(p)

        def refused(messages: list) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as error:
                prefill_side.TransferKV(iter(messages), timeout=30)
            return error.value.code()  # type: ignore[attr-defined]

        # 1. A guessed token is refused; the holder of the real one gets through, and its tokens stream.
        call, token = reserve(gateway_side, "forged")
        assert refused(kv_stream(gateway_side, "forged", "a-guess")) == grpc.StatusCode.PERMISSION_DENIED
        messages = kv_stream(gateway_side, "forged", token)
        prefill_side.TransferKV(iter(messages), timeout=30)
        assert list(call)[-1].tokens.finish_reason
        # 2. The same stream again: the token was used.
        assert refused(messages) == grpc.StatusCode.PERMISSION_DENIED
        # 3. A reservation whose KV never comes: its call ends when the lease does, and its token is refused after.
        call, token = reserve(gateway_side, "expired")
        with pytest.raises(grpc.RpcError) as expired:
            list(call)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        assert "lease" in expired.value.details()  # type: ignore[attr-defined]  # not the call's own 30 s deadline
        assert refused(kv_stream(gateway_side, "expired", token)) == grpc.StatusCode.PERMISSION_DENIED
    # 4. Leak check: nothing held on any worker.
    assert_nothing_held(secured)


def test_the_health_probe_speaks_mutual_tls(secured: Cluster, certs: Path) -> None:
    probe = [sys.executable, "-m", "pdserve.cli", "health", secured.decode[0].address, "--timeout", "5"]
    identity = _identity(certs, "client").flags()
    assert subprocess.run([*probe, *identity], capture_output=True, timeout=60).returncode == 0
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 1  # plain text: refused


def test_the_cli_client_speaks_mutual_tls(secured: Cluster, certs: Path) -> None:
    command = [sys.executable, "-m", "pdserve.cli", "generate", "Hi", "--address", secured.gateway.address,
               "--max-tokens", "3", "--json", "--timeout", "60"]
    identity = _identity(certs, "client").flags()
    done = subprocess.run([*command, *identity], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["usage"]["completion_tokens"] >= 1
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
