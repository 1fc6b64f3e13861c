"""The prefix cache is scoped per tenant: a prompt reuses only the prefixes cached under its own cache salt (by
default its API key's), so `cached_tokens` tells no key anything about another key's prompts; keys that send the
same explicit cache_salt share. A real cluster on loopback with two API keys, over gRPC and HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.request import GenerateParams, effective_cache_salt
from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2
from protos.types import SamplingParams
from tests.helpers import assert_nothing_held, start_keyed_cluster

ALICE, BOB = "sk-alice-cache", "sk-bob-cache"
BLOCK = 16  # the prefill worker's prefix blocks (its default)
SYSTEM_TEXT = "You are the support assistant of Example Corp. Never reveal the discount code PX-7781. " * 12


@pytest.fixture(scope="module")
def two_tenants(tiny_model_dir: Path) -> Iterator[Cluster]:
    """One prefill worker: every prompt meets the same prefix cache, whichever key sent it."""
    cluster = start_keyed_cluster(tiny_model_dir, [ALICE, BOB])
    yield cluster
    cluster.stop()


def _cached(cluster: Cluster, key: str, prompt: list[int], **fields: Any) -> int:
    completion = generate(cluster.gateway.address, 60, key, token_ids=prompt, max_tokens=2, temperature=0, **fields)
    assert completion.finish_reason and completion.usage is not None
    return completion.usage.cached_tokens


def _chat(cluster: Cluster, key: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"messages": [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0, **fields}
    request = urllib.request.Request(f"http://{cluster.gateway.http}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_a_key_is_told_only_of_its_own_cached_prefixes(two_tenants: Cluster) -> None:
    prompt = list(range(2000, 2100)) + [7] * 10  # 6 full blocks of a shared system prompt, then a question
    # 1. Alice's prompt is computed and cached.
    assert _cached(two_tenants, ALICE, prompt) == 0
    # 2. Bob sends the very same prompt: nothing of Alice's is reused or reported.
    assert _cached(two_tenants, BOB, prompt) == 0
    # 3. Alice's own prefix is still there for her, and now Bob's for him.
    assert _cached(two_tenants, ALICE, prompt) == 6 * BLOCK
    assert _cached(two_tenants, BOB, prompt) == 6 * BLOCK
    assert_nothing_held(two_tenants)


def test_keys_that_send_the_same_cache_salt_share_the_cache(two_tenants: Cluster) -> None:
    prompt = list(range(3000, 3100)) + [8] * 10
    assert _cached(two_tenants, ALICE, prompt, cache_salt="team-secret") == 0
    assert _cached(two_tenants, BOB, prompt, cache_salt="team-secret") == 6 * BLOCK
    # the salt's namespace is neither key's own, nor another salt's
    assert _cached(two_tenants, ALICE, prompt) == 0
    assert _cached(two_tenants, BOB, prompt, cache_salt="another-secret") == 0
    assert_nothing_held(two_tenants)


def test_a_chat_over_http_is_told_nothing_of_another_key_s_system_prompt(two_tenants: Cluster) -> None:
    usage = [_chat(two_tenants, key)[1]["usage"] for key in (ALICE, BOB, ALICE)]
    prompt_tokens = usage[0]["prompt_tokens"]
    assert prompt_tokens > 10 * BLOCK  # long enough that a shared cache would have given most of it away
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 0, (prompt_tokens - 1) // BLOCK * BLOCK]
    # the same conversation under a salt both keys hold: Bob reuses what Alice's request cached under it
    shared = [_chat(two_tenants, key, cache_salt="s3cret")[1]["usage"] for key in (ALICE, BOB)]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in shared] == [0, (prompt_tokens - 1) // BLOCK * BLOCK]
    assert_nothing_held(two_tenants)


@pytest.mark.parametrize("salt", ["x" * 257, "a\nb"], ids=["too long", "not printable"])
def test_a_bad_cache_salt_is_refused_over_grpc(two_tenants: Cluster, salt: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(two_tenants.gateway.address, 60, ALICE, token_ids=[1, 2, 3], max_tokens=2, cache_salt=salt)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "cache_salt" in refused.value.details()  # type: ignore[attr-defined]


@pytest.mark.parametrize("salt", [5, "", ["a"], None, "x" * 257, "\x07"],
                         ids=["number", "empty", "list", "null", "too long", "not printable"])
def test_a_bad_cache_salt_is_refused_over_http(two_tenants: Cluster, salt: Any) -> None:
    status, body = _chat(two_tenants, ALICE, cache_salt=salt)
    if salt is None:  # JSON null: as if absent
        assert status == 200
        return
    assert status == 400 and "cache_salt" in body["error"]["message"]
    assert body["error"]["param"] in ("cache_salt", None)  # None: refused by the checks gRPC shares


def test_workers_check_the_cache_salt_and_a_colocated_prompt_carries_it(two_tenants: Cluster) -> None:
    sampling = worker_pb2.SamplingParams(top_p=1)
    refused = []
    with grpc.insecure_channel(two_tenants.prefill[0].address) as p, \
            grpc.insecure_channel(two_tenants.decode[0].address) as d:
        prefill, decode = prefill_pb2_grpc.PrefillStub(p), decode_pb2_grpc.DecodeStub(d)
        calls: list[tuple[Any, Any]] = []
        for salt in ("x" * 257, "a\tb"):
            calls.append((prefill.Prefill, prefill_pb2.PrefillRequest(
                request_id="p", token_ids=[1, 2, 3], decode_address="127.0.0.1:1", reservation_token="t",
                sampling=sampling, cache_salt=salt)))
            calls.append((decode.Generate, decode_pb2.DecodeRequest(
                request_id="d", prompt_tokens=3, max_tokens=2, prompt_token_ids=[1, 2, 3], sampling=sampling,
                cache_salt=salt)))
        calls.append((decode.Generate, decode_pb2.DecodeRequest(  # a salt without a prompt to salt
            request_id="d", prompt_tokens=3, max_tokens=2, sampling=sampling, cache_salt="fine")))
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as error:
                list(method(request, timeout=10))
            refused.append((error.value.code(), "cache_salt" in error.value.details()))  # type: ignore[attr-defined]
        # a well-formed salt on a colocated request is taken, and the request runs to its end
        events = list(decode.Generate(decode_pb2.DecodeRequest(
            request_id="ok", prompt_tokens=3, max_tokens=2, prompt_token_ids=[1, 2, 3], ignore_eos=True,
            sampling=sampling, cache_salt="tenant-namespace"), timeout=60))
    assert refused == [(grpc.StatusCode.INVALID_ARGUMENT, True)] * 5
    assert events[-1].tokens.finish_reason == "length"
    assert_nothing_held(two_tenants)


def test_the_effective_salt_keeps_a_chosen_salt_apart_from_every_key_s_and_survives_a_migration() -> None:
    tenant = "0123456789abcdef"
    assert effective_cache_salt("", "") == ""  # no keys: one shared namespace, as before tenants
    assert len({effective_cache_salt("", tenant), effective_cache_salt(tenant, ""),
                effective_cache_salt(tenant, tenant), effective_cache_salt("", "fedcba9876543210")}) == 3
    assert effective_cache_salt("team", tenant) == effective_cache_salt("team", "fedcba9876543210")
    params = GenerateParams("r", [1, 2, 3], 8, SamplingParams(), [], False,
                            cache_salt=effective_cache_salt("", tenant))
    assert params.continued([4, 5]).cache_salt == params.cache_salt  # a migrated stream keeps its namespace
