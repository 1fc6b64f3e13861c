"""Request ids belong to the API key that sent them: a Cancel reaches only its own key's requests, cannot tell
another key's ids from unknown ones, and two keys may use the same id at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.client import stream
from pdserve.cluster import Cluster
from protos import gateway_pb2, gateway_pb2_grpc
from tests.helpers import assert_nothing_held, start_keyed_cluster

ALICE, BOB = "sk-alice", "sk-bob"
LONG = {"prompt": "Tell me a story", "max_tokens": 480, "ignore_eos": True, "request_id": "shared"}


@pytest.fixture(scope="module")
def two_tenants(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = start_keyed_cluster(tiny_model_dir, [ALICE, BOB])
    yield cluster
    cluster.stop()


def _cancel(cluster: Cluster, key: str, request_id: str) -> bool:
    with grpc.insecure_channel(cluster.gateway.address) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Cancel(
            gateway_pb2.CancelRequest(request_id=request_id), timeout=10,
            metadata=[("authorization", f"Bearer {key}")])
    return reply.cancelled


def test_a_cancel_reaches_only_its_own_key_s_request(two_tenants: Cluster) -> None:
    address = two_tenants.gateway.address
    # 1. Alice and Bob each run a request with the same id at once: no ALREADY_EXISTS between keys.
    alice = stream(address, 60, api_key=ALICE, **LONG)
    bob = stream(address, 60, api_key=BOB, **LONG)
    next(alice)
    next(bob)
    # 2. Bob's Cancel of "shared" ends his own request, not Alice's.
    assert _cancel(two_tenants, BOB, "shared")
    with pytest.raises(grpc.RpcError) as ended:
        for _ in bob:
            pass
    assert ended.value.code() == grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
    # 3. Bob cannot see or touch Alice's "shared" any more: it looks exactly like an id that does not exist.
    assert not _cancel(two_tenants, BOB, "shared") and not _cancel(two_tenants, BOB, "no-such-id")
    # 4. Alice's request runs to its end.
    last = list(alice)[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == LONG["max_tokens"]
    assert_nothing_held(two_tenants)


def test_the_same_key_cannot_run_one_id_twice_at_once(two_tenants: Cluster) -> None:
    address = two_tenants.gateway.address
    first = stream(address, 60, api_key=ALICE, **LONG)
    next(first)
    with pytest.raises(grpc.RpcError) as twice:
        next(stream(address, 60, api_key=ALICE, **LONG))
    assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
    assert _cancel(two_tenants, ALICE, "shared")
    with pytest.raises(grpc.RpcError):
        for _ in first:
            pass
    assert_nothing_held(two_tenants)
