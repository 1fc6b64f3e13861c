"""Fuzzing the two front doors, bounded: random OpenAI JSON bodies and random gRPC requests (well-formed
messages with random field values, and raw bytes that are not a message at all) against a real gateway.

Every answer must be a success or a precise refusal: an HTTP status below 500 with an OpenAI error object, or a
gRPC status other than UNKNOWN and INTERNAL; and nothing may be held afterwards. `make test` runs
PDSERVE_FUZZ_EXAMPLES (default 60) examples per target; `make fuzz` runs many more.
"""

from __future__ import annotations

import http.client
import json
import os
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cluster import Cluster
from protos import gateway_pb2, gateway_pb2_grpc
from tests.helpers import assert_nothing_held

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("PDSERVE_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
REFUSED_GRPC = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

# JSON values of every kind, small: odd numbers (huge, negative, denormal, -0.0), odd strings, nesting.
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                     st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([5e-324, -0.0, 1e308, 2.0]),
                     st.text(max_size=40), st.sampled_from(["", "\x00", "\ud7ff", "😀" * 3, "<|im_start|>"]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), _JSON),
                                  "content": st.one_of(st.text(max_size=60), _JSON)})
_COMMON = {
    "model": st.one_of(st.just("smollm2"), _JSON),
    # Small when valid, so an accepted request finishes fast; anything else when not.
    "max_tokens": st.one_of(st.integers(min_value=1, max_value=4), _JSON),
    "temperature": st.one_of(st.floats(min_value=0, max_value=2), _JSON),
    "top_p": st.one_of(st.floats(min_value=0, max_value=1), _JSON),
    "seed": _JSON, "stop": st.one_of(st.lists(st.text(max_size=5), max_size=5), _JSON),
    "stream": st.one_of(st.booleans(), _JSON), "stream_options": _JSON, "ignore_eos": _JSON, "n": _JSON,
    "logprobs": _JSON, "user": _JSON,
}


def _body(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    prompt = {"messages": st.one_of(st.lists(_MESSAGE, max_size=3), _JSON)} if chat else \
        {"prompt": st.one_of(st.text(max_size=80), st.lists(st.integers(-5, 60000), max_size=8), _JSON)}
    known = st.fixed_dictionaries({}, optional={**_COMMON, **prompt})
    return st.builds(lambda fields, extra: {**extra, **fields}, known,
                     st.dictionaries(st.text(max_size=10), _JSON, max_size=2))


def _post(cluster: Cluster, path: str, body: bytes) -> tuple[int, bytes]:
    host, port = cluster.gateway.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _check_http(status: int, payload: bytes) -> None:
    assert status < 500, (status, payload[:300])
    if status != 200:
        error = json.loads(payload)["error"]
        assert error["message"] and error["type"], payload[:300]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_random_json_bodies_get_an_answer_or_a_precise_refusal(tiny_cluster: Cluster, path: str) -> None:
    @FUZZ
    @given(body=_body(chat="chat" in path))
    def one(body: dict[str, Any]) -> None:
        _check_http(*_post(tiny_cluster, path, json.dumps(body).encode()))

    one()
    assert_nothing_held(tiny_cluster, within_s=5)


def test_random_bytes_as_a_body_are_refused_precisely(tiny_cluster: Cluster) -> None:
    @FUZZ
    @given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
    def one(raw: bytes) -> None:
        status, payload = _post(tiny_cluster, "/v1/completions", raw)
        assert status != 200 or raw.strip().startswith(b"{"), (raw, status)
        _check_http(status, payload)

    one()
    assert_nothing_held(tiny_cluster, within_s=5)


def test_random_grpc_requests_get_an_answer_or_a_precise_status(tiny_cluster: Cluster) -> None:
    u32 = st.integers(0, 2**32 - 1)
    message = st.builds(gateway_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "", "x"]),
                        content=st.text(max_size=40))
    known = {"prompt": st.text(max_size=80), "token_ids": st.lists(u32, max_size=6),
             # small when valid, so an accepted request finishes fast; or far beyond any context
             "max_tokens": st.one_of(st.integers(0, 4), st.integers(2**20, 2**32 - 1)),
             "temperature": st.floats(width=32), "top_p": st.floats(width=32), "seed": st.integers(0, 2**64 - 1),
             "stop": st.lists(st.text(max_size=6), max_size=4), "request_id": st.text(max_size=20), "top_k": u32,
             "ignore_eos": st.booleans(), "messages": st.lists(message, max_size=3)}

    with grpc.insecure_channel(tiny_cluster.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        @FUZZ
        @given(values=st.fixed_dictionaries({}, optional=known))
        def one(values: dict[str, Any]) -> None:
            request = gateway_pb2.GenerateRequest(**values)
            try:
                for _ in stub.Generate(request, timeout=60):
                    pass
            except grpc.RpcError as exc:
                assert exc.code() not in REFUSED_GRPC, (request, exc.code(), exc.details())  # type: ignore[attr-defined]

        one()

        raw_generate = channel.unary_stream("/pdserve.v1.Gateway/Generate", request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)

        @FUZZ
        @given(raw=st.binary(max_size=120))
        def raw_bytes(raw: bytes) -> None:
            try:
                for _ in raw_generate(raw, timeout=60):
                    pass
            except grpc.RpcError as exc:
                assert exc.code() not in REFUSED_GRPC, (raw, exc.code(), exc.details())  # type: ignore[attr-defined]

        raw_bytes()
    assert_nothing_held(tiny_cluster, within_s=5)
