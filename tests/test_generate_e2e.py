"""Gateway -> prefill -> KV transfer -> decode, as real processes, on the tiny random model."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from pdserve.client import generate, stream
from pdserve.cluster import Cluster
from protos import gateway_pb2, gateway_pb2_grpc
from tests.helpers import (
    PROMPTS,
    assert_greedy_matches_hugging_face,
    assert_nothing_held,
    assert_nothing_live,
    start_cluster,
)

pytestmark = pytest.mark.leak_check("tiny_cluster")


def test_greedy_matches_hugging_face_for_concurrent_prompts(tiny_cluster: Cluster, tiny_model_dir: Path) -> None:
    completions = assert_greedy_matches_hugging_face(tiny_cluster, tiny_model_dir)
    assert {c.timing.kv_transport for c in completions} == {"shm"}  # same host: the fast path is chosen by itself
    assert all(c.timing.kv_bytes > 0 for c in completions)


# Layer streaming and the shared-memory path switched off one at a time, and both: same tokens every time. With
# 8-token chunks every prompt has passes to itself, computed straight into decode's segment, position by position.
@pytest.mark.parametrize(("prefill_args", "transport"), [
    (("--no-kv-shm",), "grpc"),
    (("--no-layer-streaming",), "shm"),
    (("--no-kv-shm", "--no-layer-streaming"), "grpc"),
    (("--prefill-chunk", "8"), "shm"),
], ids=["grpc-streamed", "shm-after-forward", "grpc-after-forward", "shm-chunked-into-the-segment"])
def test_greedy_identity_holds_on_every_kv_path(
    tiny_model_dir: Path, prefill_args: tuple[str, ...], transport: str
) -> None:
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=1, prefill_args=prefill_args)
    try:
        completions = assert_greedy_matches_hugging_face(cluster, tiny_model_dir)
        assert {c.timing.kv_transport for c in completions} == {transport}
        assert all(c.timing.kv_bytes > 0 for c in completions)
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


def test_token_ids_prompt_gives_same_tokens_as_text_prompt(tiny_cluster: Cluster, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    address = tiny_cluster.gateway.address
    by_text = generate(address, timeout=60, prompt=PROMPTS[2], max_tokens=8, temperature=0.0,
                     ignore_eos=True)
    by_ids = generate(address, timeout=60, token_ids=tokenizer(PROMPTS[2]).input_ids, max_tokens=8, temperature=0.0)
    assert by_ids.token_ids == by_text.token_ids


def test_streams_token_by_token_and_text_joins_to_decoded_output(tiny_cluster: Cluster, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    responses = list(stream(tiny_cluster.gateway.address, timeout=60, prompt="Once upon a time", max_tokens=16,
                            temperature=0.0, ignore_eos=True))
    assert len(responses) > 2  # streamed, not one message at the end
    assert all(r.finish_reason == "" for r in responses[:-1]) and responses[-1].finish_reason == "length"
    token_ids = [t for r in responses for t in r.token_ids]
    assert len(token_ids) == 16
    assert "".join(r.text for r in responses) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len({r.request_id for r in responses}) == 1


def test_seeded_sampling_is_reproducible(tiny_cluster: Cluster) -> None:
    address = tiny_cluster.gateway.address
    runs = [generate(address, timeout=60, prompt="Tell me a story", max_tokens=12, temperature=1.0, top_p=0.9,
                     seed=1234, ignore_eos=True) for _ in range(2)]
    other = generate(address, timeout=60, prompt="Tell me a story", max_tokens=12, temperature=1.0, top_p=0.9,
                     seed=99, ignore_eos=True)
    assert runs[0].token_ids == runs[1].token_ids
    assert other.token_ids != runs[0].token_ids


def test_stop_string_ends_the_completion_before_it(tiny_cluster: Cluster) -> None:
    address = tiny_cluster.gateway.address
    full = generate(address, timeout=60, prompt="The capital of France is", max_tokens=24, temperature=0.0,
                    ignore_eos=True)
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), f"need a visible stop string from {full.text!r}"
    stopped = generate(address, timeout=60, prompt="The capital of France is", max_tokens=24, temperature=0.0,
                       ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_max_tokens_one_and_request_id_echo(tiny_cluster: Cluster) -> None:
    completion = generate(tiny_cluster.gateway.address, timeout=60, prompt="Hello", max_tokens=1, temperature=0.0,
                          request_id="my-request-1")
    assert completion.request_id == "my-request-1"
    assert len(completion.token_ids) == 1
    assert completion.finish_reason in ("length", "stop")


BAD_REQUESTS = [
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "token_ids": [1, 2]}, "prompt and token_ids"),
    ({"token_ids": [1, 49152]}, "token_ids[1]"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ({"token_ids": [5] * 600}, "prompt is 600 tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "request_id": "x" * 200}, "request_id"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
]


@pytest.mark.parametrize(("fields", "named"), BAD_REQUESTS, ids=[str(f)[:40] for f, _ in BAD_REQUESTS])
def test_bad_input_is_refused_with_invalid_argument_and_service_keeps_serving(
    tiny_cluster: Cluster, fields: dict, named: str
) -> None:
    address = tiny_cluster.gateway.address
    with pytest.raises(grpc.RpcError) as refused:
        generate(address, timeout=30, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in refused.value.details()
    ok = generate(address, timeout=60, prompt="Hello there", max_tokens=4, temperature=0.0)
    assert len(ok.token_ids) >= 1 and ok.finish_reason


def test_cancelling_mid_stream_frees_every_worker(tiny_cluster: Cluster) -> None:
    # 1. Start a long completion and read a few pieces.
    responses = stream(tiny_cluster.gateway.address, timeout=60, prompt="Count to one thousand:", max_tokens=400,
                       temperature=0.0, ignore_eos=True)
    for _ in range(3):
        next(responses)
    # 2. Leave the stream: the client cancels the call.
    responses.close()
    # 3. Leak check: every live gauge, gateway included, is back at zero.
    assert_nothing_live(tiny_cluster)
    # 4. A new request succeeds (and the module's leak check runs after it).
    assert generate(tiny_cluster.gateway.address, timeout=60, prompt="Hi", max_tokens=2).finish_reason


def test_deadline_passing_mid_stream_ends_deadline_exceeded_and_frees_every_worker(tiny_model_dir: Path) -> None:
    # Its own cluster: polls are rare, so the gateway takes the decode worker frozen below for slow, not gone (the
    # stream's idle timeout, 5 s, is past its deadline too).
    cluster = start_cluster(tiny_model_dir, gateway_args=("--poll-interval=60",))
    decode = cluster.decode[0].process
    try:
        # 0. Warm up: a fresh worker's first request loads what it needs, which must not eat into the deadline.
        assert generate(cluster.gateway.address, timeout=60, prompt="Hi", max_tokens=2).finish_reason
        # 1. A long completion under a 3 s deadline (far over a warm first piece: milliseconds, tenths of a second
        # on a busy machine); its first piece has come.
        responses = stream(cluster.gateway.address, timeout=3, prompt="Count to one thousand:", max_tokens=450,
                           temperature=0.0, ignore_eos=True)
        next(responses)
        # 2. Decode freezes, so the rest cannot come before the deadline, however fast the machine: a timed race
        # (0.5 s for 450 tokens) failed in CI once a machine decoded them in 475 ms.
        decode.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as expired:
                for _ in responses:
                    pass
        finally:
            decode.send_signal(signal.SIGCONT)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # 3. Leak check: the thawed decode worker finds the call cancelled and frees it.
        assert_nothing_live(cluster, within_s=10)
        assert generate(cluster.gateway.address, timeout=30, prompt="Hi", max_tokens=2).finish_reason
    finally:
        cluster.stop()


def test_request_id_in_flight_is_refused_with_already_exists(tiny_cluster: Cluster) -> None:
    address = tiny_cluster.gateway.address
    # 1. A stream runs under a request id.
    running = stream(address, timeout=60, prompt="Count to one thousand:", max_tokens=400, temperature=0.0,
                     ignore_eos=True, request_id="same-id")
    next(running)
    # 2. A second request with that id is refused while the first runs.
    with pytest.raises(grpc.RpcError) as duplicate:
        generate(address, timeout=30, prompt="Hi", max_tokens=2, request_id="same-id")
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # 3. Cancel the first; leak check.
    running.close()
    assert_nothing_live(tiny_cluster)
    # 4. The id is free again.
    assert generate(address, timeout=30, prompt="Hi", max_tokens=2, request_id="same-id").finish_reason


def test_bfloat16_wire_halves_the_kv_bytes_and_still_generates(tiny_cluster: Cluster, tiny_model_dir: Path) -> None:
    exact = generate(tiny_cluster.gateway.address, timeout=60, prompt=PROMPTS[2], max_tokens=8, temperature=0.0,
                     ignore_eos=True)
    lossy_cluster = start_cluster(tiny_model_dir, prefill_args=("--wire-dtype=bfloat16",))
    try:
        lossy = generate(lossy_cluster.gateway.address, timeout=60, prompt=PROMPTS[2], max_tokens=8, temperature=0.0,
                     ignore_eos=True)
        assert lossy.timing.kv_bytes * 2 == exact.timing.kv_bytes
        assert len(lossy.token_ids) == len(exact.token_ids) and lossy.finish_reason == exact.finish_reason
        assert_nothing_held(lossy_cluster)
    finally:
        lossy_cluster.stop()


def test_cancel_by_request_id_ends_the_stream_and_frees_every_worker(tiny_cluster: Cluster) -> None:
    address = tiny_cluster.gateway.address
    # 1. A stream runs under a request id.
    responses = stream(address, 60, prompt=PROMPTS[3], max_tokens=400, ignore_eos=True, request_id="to-cancel")
    next(responses)
    with grpc.insecure_channel(address) as channel:  # another connection, as an operator's tool would use
        gateway = gateway_pb2_grpc.GatewayStub(channel)
        # 2. Cancel it by id: the stream ends CANCELLED, saying why.
        assert gateway.Cancel(gateway_pb2.CancelRequest(request_id="to-cancel"), timeout=10).cancelled
        with pytest.raises(grpc.RpcError) as ended:
            for _ in responses:
                pass
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert "cancelled by a Cancel call" in (ended.value.details() or "")
        # 3. A second Cancel finds nothing; one without an id is refused.
        assert not gateway.Cancel(gateway_pb2.CancelRequest(request_id="to-cancel"), timeout=10).cancelled
        with pytest.raises(grpc.RpcError) as refused:
            gateway.Cancel(gateway_pb2.CancelRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # 4. Leak check.
    assert_nothing_live(tiny_cluster)
