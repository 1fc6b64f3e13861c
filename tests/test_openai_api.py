"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client against a real cluster, and
API keys on both transports."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from transformers import AutoTokenizer

from gateway.auth import API_KEYS_ENV, ApiKeys
from gateway.openai_api import OpenAIServer
from gateway.request import MAX_STOP_CHARS
from pdserve.client import generate, stream
from pdserve.cluster import Cluster, Service, stop_all, wait_ready
from protos import gateway_pb2, gateway_pb2_grpc
from tests.helpers import assert_nothing_held, assert_nothing_live, live_gauges, start_cluster

KEY = "sk-test-0123456789"
MODEL = "tiny-llama"  # --served-model-name


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator[Cluster]:
    """One request at a time (--max-in-flight 1, no queue), so a second one is refused for load."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDSERVE_API_KEYS", KEY)
        cluster = start_cluster(tiny_model_dir, gateway_args=("--max-in-flight=1", "--max-queue=0",
                                                              f"--served-model-name={MODEL}"))
    yield cluster
    cluster.stop()


@pytest.fixture
def client(keyed: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{keyed.gateway.http}/v1", api_key=KEY, max_retries=0, timeout=60)


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]


def test_chat_streams_the_same_tokens_as_grpc_with_usage(client: openai.OpenAI, keyed: Cluster) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,  # type: ignore
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    # The gateway applies the chat template for gRPC `messages` too: the same tokens, the same text.
    same = generate(keyed.gateway.address, 60, KEY, messages=CHAT, max_tokens=8, temperature=0, ignore_eos=True)
    assert same.text == text and same.usage.prompt_tokens == usage.prompt_tokens  # type: ignore[union-attr]
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,  # type: ignore
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.total_tokens == usage.prompt_tokens + 8
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    # The third time this conversation is prefilled, its full blocks come from the prefix cache.
    details = whole.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_completions_honour_max_tokens_and_stop(client: openai.OpenAI, keyed: Cluster) -> None:
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage is not None
    assert full.usage.completion_tokens == 12
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:3]  # a stop string from the middle of the greedy text
    assert stop.strip()
    stopped = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                        temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == text
    assert_nothing_held(keyed)


def test_a_tiny_temperature_is_greedy_on_both_transports(client: openai.OpenAI, keyed: Cluster) -> None:
    """Below 1e-5 sampling is greedy, as in vLLM; logits divided by 1e-40 were inf, and the request a 500."""
    request = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
               "extra_body": {"ignore_eos": True}}
    greedy = client.completions.create(temperature=0, **request).choices[0].text  # type: ignore[call-overload]
    for temperature in (1e-40, 5e-324):  # a float32 denormal; a float64 one, 0 in the request's float field
        tiny = client.completions.create(temperature=temperature, **request)  # type: ignore[call-overload]
        assert tiny.choices[0].text == greedy and tiny.choices[0].finish_reason == "length"
    for temperature in (1e-40, 1e-45):  # 1e-45: the smallest float32 denormal
        done = generate(keyed.gateway.address, 60, KEY, prompt="The capital of France is", max_tokens=6,
                        temperature=temperature, ignore_eos=True)
        assert done.text == greedy and done.finish_reason == "length"
    assert_nothing_held(keyed)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 5}, "temperature"),  # over [0, 2]: one rule for both APIs (protos/types.check_temperature)
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"seed": 2**70}, "seed"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, None),
])
def test_bad_parameters_are_400_with_the_parameter_named(client: openai.OpenAI, keyed: Cluster,
                                                          kwargs: dict, param: str | None) -> None:
    request = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**request)
    assert refused.value.status_code == 400
    error = refused.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param
    else:
        assert next(iter(kwargs)) in error["message"] or "role" in error["message"]
    assert_nothing_held(keyed)


def test_an_over_long_stop_string_is_refused_on_both_transports(client: openai.OpenAI, keyed: Cluster) -> None:
    """A stop string's length is capped (the 300,000-character one held the gateway's event loop for seconds)."""
    for too_long in ("x" * (MAX_STOP_CHARS + 1), "x" * 300_000):
        stop = ["\n", too_long]
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stop=stop)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "stop" and error["code"] == "invalid_parameter"
        assert f"stop[1] is {len(too_long)} characters" in error["message"]
        with pytest.raises(grpc.RpcError) as grpc_refused:
            generate(keyed.gateway.address, 30, KEY, prompt="Hi", max_tokens=2, stop=stop)
        assert grpc_refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert f"stop[1] is {len(too_long)} characters" in grpc_refused.value.details()  # type: ignore[attr-defined]
    at_cap = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stop=["x" * MAX_STOP_CHARS],
                                       extra_body={"ignore_eos": True})
    assert at_cap.choices[0].finish_reason in ("length", "stop")
    assert generate(keyed.gateway.address, 30, KEY, prompt="Hi", max_tokens=2, ignore_eos=True,
                    stop=["x" * MAX_STOP_CHARS]).finish_reason
    assert_nothing_held(keyed)


def test_bad_key_unknown_model_and_bad_json_are_refused(keyed: Cluster) -> None:
    wrong = openai.OpenAI(base_url=f"http://{keyed.gateway.http}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    good = openai.OpenAI(base_url=f"http://{keyed.gateway.http}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        good.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=2)
    assert missing.value.code == "model_not_found"
    status, body, _ = _post(keyed, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body, _ = _post(keyed, "/v1/completions", json.dumps({"prompt": [1, 2**40]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body, _ = _post(keyed, "/v1/nowhere", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_grpc_needs_the_key_too(keyed: Cluster) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(keyed.gateway.address, 30, prompt="Hi", max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    with grpc.insecure_channel(keyed.gateway.address) as channel, pytest.raises(grpc.RpcError) as cancel:
        gateway_pb2_grpc.GatewayStub(channel).Cancel(gateway_pb2.CancelRequest(request_id="x"), timeout=10,
                                                      metadata=[("authorization", "Bearer sk-wrong")])
    assert cancel.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert generate(keyed.gateway.address, 30, KEY, prompt="Hi", max_tokens=2).finish_reason


def test_refused_for_load_is_429_with_retry_after(client: openai.OpenAI, keyed: Cluster) -> None:
    holding = stream(keyed.gateway.address, 60, KEY, prompt="Tell me a story", max_tokens=400, ignore_eos=True)
    next(holding)  # the one place is taken
    try:
        status, body, headers = _post(keyed, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode())
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) >= 1
    finally:
        holding.close()  # type: ignore[attr-defined]
    assert_nothing_live(keyed, within_s=5.0)


def test_disconnecting_an_sse_client_frees_everything_on_every_service(keyed: Cluster) -> None:
    host, port = keyed.gateway.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type", "").startswith("text/event-stream")
    events = 0
    while events < 3:  # the stream is live: a few events arrived
        line = response.readline()
        events += line.startswith(b"data: ")
    live = live_gauges(keyed)
    assert live["pdserve_live_requests"] == 1 and live["pdserve_live_sequences"] == 1
    connection.sock.close()  # type: ignore[union-attr]  # the client goes away mid-stream
    connection.close()
    assert_nothing_live(keyed, within_s=5.0)
    assert_nothing_held(keyed)


def _post(cluster: Cluster, path: str, body: bytes) -> tuple[int, dict, dict[str, str]]:
    host, port = cluster.gateway.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, body, headers={"Authorization": f"Bearer {KEY}",
                                                        "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read()), dict(response.getheaders())
    finally:
        connection.close()


@pytest.mark.parametrize("content", ["", "\n\n", "   \n\t\n"])
def test_a_key_file_holding_no_key_stops_the_gateway_at_start_up(tmp_path: Path, content: str) -> None:
    """An empty --api-key-file used to turn authentication off without a word: now the gateway refuses to start,
    naming the flag, before it loads anything."""
    empty = tmp_path / "keys"
    empty.write_text(content)
    with pytest.raises(ValueError, match="--api-key-file .* holds no key"):
        ApiKeys.load(str(empty))
    env = {k: v for k, v in os.environ.items() if k != API_KEYS_ENV}
    started = subprocess.run([sys.executable, "-m", "gateway", "--decode", "127.0.0.1:1", "--api-key-file",
                              str(empty)], capture_output=True, text=True, timeout=120, env=env)
    assert started.returncode == 2, started.stderr
    assert f"--api-key-file {empty} holds no key" in started.stderr


def test_key_sources_that_hold_keys_or_are_unset_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text("\n sk-one \n\nsk-two\n")
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    loaded = ApiKeys.load(str(keys))
    assert loaded.allows({"authorization": "Bearer sk-two"}) and not loaded.allows({"authorization": "Bearer x"})
    assert ApiKeys.load().allows({})  # no key configured anywhere: open, as documented
    monkeypatch.setenv(API_KEYS_ENV, "")  # empty counts as unset
    assert ApiKeys.load().allows({})
    monkeypatch.setenv(API_KEYS_ENV, " , ")
    with pytest.raises(ValueError, match=f"{API_KEYS_ENV} is set but holds no key"):
        ApiKeys.load()


def test_a_stop_string_s_tokens_are_not_returned_and_the_text_is_their_text(client: openai.OpenAI, keyed: Cluster,
                                                                           tiny_model_dir: Path) -> None:
    """gateway.proto: generation ends before the stop string, "which is not returned"; its tokens used to be."""
    request = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = generate(keyed.gateway.address, 60, KEY, **request)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert full.text == tokenizer.decode(full.token_ids, skip_special_tokens=True)
    # a stop string made of two whole tokens from the middle, whose first occurrence is there
    for k in range(len(full.token_ids) // 2, len(full.token_ids) - 2):
        head = tokenizer.decode(full.token_ids[:k], skip_special_tokens=True)
        stop = tokenizer.decode(full.token_ids[k : k + 2], skip_special_tokens=True)
        if stop.strip() and "\ufffd" not in head + stop and full.text.find(stop) == len(head):
            break
    else:
        pytest.fail(f"no two-token stop string in {full.text!r}")
    stopped = generate(keyed.gateway.address, 60, KEY, stop=[stop], **request)
    assert (stopped.text, stopped.finish_reason) == (head, "stop")
    assert stopped.token_ids == full.token_ids[:k]
    assert stopped.usage is not None and stopped.usage.completion_tokens == k + 2  # up to the stop string's end
    over_http = client.completions.create(model=MODEL, prompt=request["prompt"], max_tokens=16, temperature=0,
                                          stop=[stop], extra_body={"ignore_eos": True})
    assert over_http.choices[0].text == head and over_http.choices[0].finish_reason == "stop"
    assert_nothing_held(keyed)


def test_a_token_without_text_streams_as_a_chunk_with_empty_content() -> None:
    """A special token's response (token ids, no text) is a chunk of its own with content "", as vLLM sends it:
    before, it waited for the next token's text, and a streaming client saw a gap of two steps. The HTTP layer
    alone, over a servicer that streams fixed responses."""

    class Streams:
        keys = ApiKeys([])

        async def stream(self, request, deadline, metadata, peer=""):  # type: ignore[no-untyped-def]
            yield gateway_pb2.GenerateResponse(request_id="r1", token_ids=[42], text="Hi")
            yield gateway_pb2.GenerateResponse(request_id="r1", token_ids=[2])  # <|im_end|>: skipped text
            yield gateway_pb2.GenerateResponse(request_id="r1", token_ids=[43], text="!", finish_reason="length")

    async def chunks() -> list[dict]:  # type: ignore[type-arg]
        server = OpenAIServer(Streams(), MODEL)
        address = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    f"http://{address}/v1/chat/completions", json={"model": MODEL, "stream": True, "messages": CHAT,
                                                                  "max_tokens": 3}) as response:
                body = await response.text()
        finally:
            await server.stop()
        return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]

    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in asyncio.run(chunks())]
    assert deltas == [({"role": "assistant", "content": ""}, None), ({"content": "Hi"}, None),
                      ({"content": ""}, None), ({"content": "!"}, "length")]


@contextlib.contextmanager
def _gateway_before(cluster: Cluster, model_dir: Path, log: Path, keys: str) -> Iterator[Service]:
    """A second gateway in front of `cluster`'s workers, with PDSERVE_API_KEYS=`keys` and its log in `log`."""
    env = {**os.environ, API_KEYS_ENV: keys}
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.launch", str(os.getpid()), "", "gateway", "--host", "127.0.0.1",
             "--port", "0", "--http-port", "0", "--model", str(model_dir),
             *[f"--prefill={w.address}" for w in cluster.prefill], *[f"--decode={w.address}" for w in cluster.decode]],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    gateway = Service("gateway", process)
    try:
        wait_ready([gateway], 120)
        yield gateway
    finally:
        stop_all([gateway], grace_s=10)


def _raw_get(address: str, authorization: bytes) -> tuple[int, bytes]:
    """GET /v1/models with an Authorization header of raw bytes, which no HTTP client library sends."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nAuthorization: " + authorization +
                     b"\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


NOT_UTF8 = [b"Bearer \xff\xfe", b"\xff\xfe", b"Bearer sk-\xc3", b"bearer \x80" + KEY.encode()]


@pytest.mark.parametrize("keys", [KEY, ""], ids=["keys", "no keys"])
def test_an_authorization_header_that_is_not_utf8_is_a_wrong_key(keyed: Cluster, tiny_model_dir: Path,
                                                                   tmp_path: Path, keys: str) -> None:
    """Bytes that are no UTF-8 in the header used to raise in the key check: HTTP 500 and a traceback in the log.
    With keys they are a wrong key (401); without keys nobody is asked for one. Either way nothing is logged."""
    log = tmp_path / "gateway.log"
    with _gateway_before(keyed, tiny_model_dir, log, keys) as gateway:
        for header in NOT_UTF8:
            status, body = _raw_get(gateway.http, header)
            assert status == (401 if keys else 200), (header, body)
            if keys:
                assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert _raw_get(gateway.http, f"Bearer {KEY}".encode())[0] == 200  # still serving
    logged = log.read_text()
    assert "Traceback" not in logged and "Error handling request" not in logged, logged


def test_grpc_metadata_that_is_not_utf8_is_a_wrong_key() -> None:
    """What grpcio hands the servicer for such a header: latin-1 text (it decodes what is not UTF-8 so), or bytes.
    (grpcio's own clients refuse to send it; other clients do.)"""
    with_keys, without = ApiKeys([KEY, "sk-\xe9t\xe9"]), ApiKeys([])
    for value in (b"Bearer \xff\xfe", b"Bearer \xff\xfe".decode("latin-1"), b"\xff", f"Bearer {KEY}\xe9".encode(),
                  b"Bearer sk-\xe9t\xe9"):  # the last: the second key in latin-1, not UTF-8
        metadata = [("user-agent", "x"), ("authorization", value)]
        assert not with_keys.allows(metadata) and with_keys.tenant(metadata) == "", value
        assert without.allows(metadata) and without.tenant(metadata) == "", value
    for value in (f"Bearer {KEY}", f"Bearer {KEY}".encode(), "Bearer sk-\xe9t\xe9", "Bearer sk-\xe9t\xe9".encode()):
        assert with_keys.allows([("authorization", value)]) and with_keys.tenant([("authorization", value)]), value
