"""Split prefill as real processes: a prefill worker prefills a long prompt's first half and sends its KV layer by
layer to the decode worker, which prefills the second half meanwhile and samples the first token itself. The
tokens are those of the whole prompt prefilled in one place; the request says it was split; nothing stays held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from model_runner.loading import LoadedModel
from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import decode_pb2, decode_pb2_grpc
from protos.types import SamplingParams
from tests.helpers import ENGINE_MAX_TOKENS, assert_nothing_held, decode_alone, start_cluster

pytestmark = pytest.mark.slow  # the real model

SPLIT_ABOVE = 64
PROMPT = [(index * 7919) % 40000 + 100 for index in range(200)]  # 200 distinct-enough tokens of the real model


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path) -> Iterator[Cluster]:
    """The default model in float32, as the in-process reference; the fixed rule splits every prompt of 64 tokens
    or more in half."""
    cluster = start_cluster(default_model_dir, gateway_args=(f"--split-above={SPLIT_ABOVE}",))
    yield cluster
    cluster.stop()


def test_a_split_prompt_decodes_as_the_whole_prompt_prefilled_in_one_place(cluster: Cluster,
                                                                          runner: LoadedModel) -> None:
    expected = decode_alone(runner, PROMPT, SamplingParams(temperature=0.0))
    completion = generate(cluster.gateway.address, timeout=120, token_ids=PROMPT, max_tokens=ENGINE_MAX_TOKENS,
                          temperature=0.0, ignore_eos=True)
    assert completion.token_ids == expected
    timing = completion.timing
    assert timing.placement == "split" and timing.placement_reason.startswith("split at 100 tokens")
    kv_per_token = runner.spec.kv_bytes_per_token
    assert timing.kv_bytes == 100 * kv_per_token  # the prefix's KV moved, not the whole prompt's
    assert timing.kv_transport in ("shm", "grpc")
    assert_nothing_held(cluster)


def test_a_short_prompt_is_not_split(cluster: Cluster, runner: LoadedModel) -> None:
    short = PROMPT[: SPLIT_ABOVE - 1]
    completion = generate(cluster.gateway.address, timeout=120, token_ids=short, max_tokens=4, temperature=0.0,
                          ignore_eos=True)
    assert completion.timing.placement == "prefill"
    assert completion.timing.kv_bytes == len(short) * runner.spec.kv_bytes_per_token
    assert_nothing_held(cluster)


@pytest.mark.parametrize(("fields", "fault"), [
    ({"split_tokens": 5}, "needs prompt_token_ids"),
    ({"split_tokens": 8, "prompt_token_ids": list(range(8))}, "must be less than prompt_tokens 8"),
    ({"split_tokens": 4, "prompt_token_ids": list(range(8)), "decoded_tokens": 2}, "a migrated stream"),
])
def test_a_bad_split_is_refused_by_name(cluster: Cluster, fields: dict, fault: str) -> None:
    request = decode_pb2.DecodeRequest(request_id="bad-split", prompt_tokens=8, max_tokens=4, **fields)
    with grpc.insecure_channel(cluster.decode[0].address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=30)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fault in refused.value.details()
    assert_nothing_held(cluster)
