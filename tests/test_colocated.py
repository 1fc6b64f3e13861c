"""Colocated mode (decode workers prefill too) and conditional disaggregation, as real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate, stream
from pdserve.cluster import Cluster
from protos import decode_pb2, decode_pb2_grpc, worker_pb2
from tests.helpers import (
    PROMPTS,
    assert_greedy_matches_hugging_face,
    assert_nothing_held,
    assert_nothing_live,
    start_cluster,
)

pytestmark = pytest.mark.leak_check("colocated")


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Path) -> Iterator[Cluster]:
    """No prefill workers; chunks of 4 tokens, so every prompt but the shortest is prefilled in several."""
    cluster = start_cluster(tiny_model_dir, prefill=0, decode=1, decode_args=("--prefill-chunk=4", "--max-seqs=4"))
    yield cluster
    cluster.stop()


def test_colocated_greedy_matches_hugging_face_for_concurrent_prompts(colocated: Cluster,
                                                                      tiny_model_dir: Path) -> None:
    completions = assert_greedy_matches_hugging_face(colocated, tiny_model_dir)
    assert {c.timing.kv_transport for c in completions} == {"colocated"}
    assert all(c.timing.kv_bytes == 0 for c in completions)  # nothing moved


def test_seeded_sampling_is_the_same_colocated_and_disaggregated(colocated: Cluster, tiny_cluster: Cluster) -> None:
    fields = {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234,
              "ignore_eos": True}
    here = generate(colocated.gateway.address, timeout=60, **fields)
    there = generate(tiny_cluster.gateway.address, timeout=60, **fields)
    assert here.timing.kv_transport == "colocated" and there.timing.kv_transport == "shm"
    assert here.token_ids == there.token_ids and len(here.token_ids) == 16


def test_cancelling_a_colocated_stream_frees_everything(colocated: Cluster) -> None:
    # 1. A long colocated stream: the decode worker prefills it in chunks, then decodes.
    responses = stream(colocated.gateway.address, 60, prompt=PROMPTS[3], max_tokens=400, ignore_eos=True)
    next(responses)
    # 2. Leave the stream: that cancels the request.
    responses.close()  # type: ignore[attr-defined]
    # 3. Leak check: every live gauge is back at zero (and the module's GetInfo check runs after the test).
    assert_nothing_live(colocated)


def test_colocated_request_with_a_bad_prompt_is_invalid_argument(colocated: Cluster) -> None:
    with grpc.insecure_channel(colocated.decode[0].address) as channel:
        decode = decode_pb2_grpc.DecodeStub(channel)
        # ids that disagree with prompt_tokens, one past the vocabulary, and every token "decoded" (none prompt)
        for prompt_tokens, ids, decoded in ((3, [1, 2], 0), (2, [1, 10**6], 0), (2, [1, 2], 2)):
            with pytest.raises(grpc.RpcError) as refused:
                next(decode.Generate(decode_pb2.DecodeRequest(
                    request_id="bad", prompt_tokens=prompt_tokens, max_tokens=2, prompt_token_ids=ids,
                    sampling=worker_pb2.SamplingParams(temperature=0.0, top_p=1.0), decoded_tokens=decoded),
                    timeout=10))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_conditional_disaggregation_routes_by_prompt_length(tiny_model_dir: Path) -> None:
    # --colocate-queued=0: short prompts are colocated even while prefill is idle (test_worker_pools has the rule)
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=1, colocate_below=8,
                            gateway_args=("--colocate-queued=0",))
    try:
        short = generate(cluster.gateway.address, timeout=60, prompt="Hi", max_tokens=4, temperature=0.0)
        long = generate(cluster.gateway.address, timeout=60, prompt=PROMPTS[2], max_tokens=4, temperature=0.0)
        assert short.usage.prompt_tokens < 8 and short.timing.kv_transport == "colocated"
        assert long.usage.prompt_tokens >= 8 and long.timing.kv_transport == "shm"
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


def test_a_short_prompt_goes_to_an_idle_prefill_worker_by_default(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=1, colocate_below=512)
    try:
        short = generate(cluster.gateway.address, timeout=60, prompt="Hi", max_tokens=4, temperature=0.0)
        assert short.usage.prompt_tokens < 512 and short.timing.kv_transport == "shm"
        assert_nothing_held(cluster)
    finally:
        cluster.stop()
