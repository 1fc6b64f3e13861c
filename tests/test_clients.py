"""Clients in other languages and without the .proto: the examples in examples/, and gRPC reflection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdserve.client import generate
from pdserve.cluster import Cluster
from tests.helpers import assert_nothing_held

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def test_a_reflection_only_client_lists_and_calls_the_gateway(tiny_cluster: Cluster) -> None:
    with grpc.insecure_channel(tiny_cluster.gateway.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"pdserve.v1.Gateway", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = descriptor_pool.DescriptorPool(database)  # every descriptor from the server, none from protos/
        gateway = pool.FindServiceByName("pdserve.v1.Gateway")
        assert {method.name for method in gateway.methods} == {"Generate", "Cancel"}
        generate_method = gateway.FindMethodByName("Generate")
        assert generate_method.server_streaming and not generate_method.client_streaming
        request_class = message_factory.GetMessageClass(generate_method.input_type)
        response_class = message_factory.GetMessageClass(generate_method.output_type)
        call = channel.unary_stream("/pdserve.v1.Gateway/Generate", request_serializer=request_class.SerializeToString,
                                    response_deserializer=response_class.FromString)
        responses = list(call(request_class(prompt=PROMPT, max_tokens=4, temperature=0.0), timeout=60))
    assert responses[-1].finish_reason == "length"
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == generate(tiny_cluster.gateway.address, 60, prompt=PROMPT, max_tokens=4, temperature=0.0).token_ids


def test_python_example_streams_and_cancels_by_leaving_the_stream(tiny_cluster: Cluster) -> None:
    script = ROOT / "examples" / "python" / "generate.py"
    whole = subprocess.run([sys.executable, str(script), "--address", tiny_cluster.gateway.address, "--max-tokens",
                            "6", PROMPT], capture_output=True, text=True, timeout=120, check=True)
    lines = [json.loads(line) for line in whole.stdout.splitlines()]
    assert lines[-1]["finish_reason"] == "length"
    expected = generate(tiny_cluster.gateway.address, 60, prompt=PROMPT, max_tokens=6, temperature=0.0)
    assert [t for line in lines for t in line["token_ids"]] == expected.token_ids
    cancelled = subprocess.run([sys.executable, str(script), "--address", tiny_cluster.gateway.address,
                                "--max-tokens", "400", "--cancel-after", "3", "Tell me a long story"],
                               capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(cancelled.stdout.splitlines()[-1])["cancelled_after"] >= 3
    assert_nothing_held(tiny_cluster)


def test_node_example_streams_the_same_tokens_as_python(tiny_cluster: Cluster) -> None:
    npm, node = shutil.which("npm"), shutil.which("node")
    assert npm and node, "node and npm are needed (both are on CI's machine)"
    example = ROOT / "examples" / "node"
    if not (example / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=example, check=True, capture_output=True,
                       timeout=300)
    result = subprocess.run([node, "generate.js", "--address", tiny_cluster.gateway.address, "--max-tokens", "8",
                             PROMPT], cwd=example, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    streamed = json.loads(result.stdout)
    expected = generate(tiny_cluster.gateway.address, 60, prompt=PROMPT, max_tokens=8, temperature=0.0)
    assert streamed["token_ids"] == expected.token_ids and streamed["text"] == expected.text
    assert streamed["finish_reason"] == "length" and int(streamed["usage"]["completion_tokens"]) == 8


@pytest.mark.parametrize("command", ["cluster", "generate", "chat", "trace", "health", "bench"])
def test_every_subcommand_has_help(command: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", command, "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "usage: pdserve " + command in result.stdout


def test_chat_cli_keeps_the_conversation(tiny_cluster: Cluster) -> None:
    turns = "What is 2+2?\nAnd 3+3?\n\n"
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "chat", "--address", tiny_cluster.gateway.address,
                             "--max-tokens", "5", "--temperature", "0", "--system", "Be brief."],
                            input=turns, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first = generate(tiny_cluster.gateway.address, 60, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "What is 2+2?"}],
                     max_tokens=5, temperature=0.0)
    second = generate(tiny_cluster.gateway.address, 60, max_tokens=5, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3+3?"}])
    # Each reply streamed, then a newline; the second turn was sent with the first in its history.
    assert result.stdout == f"{first.text}\n{second.text}\n"
