"""Shared fixtures: the real tokenizer, a tiny random model that uses it, and clusters of real processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_runner.loading import resolve_model
from pdserve.cluster import Cluster, ClusterConfig, start
from protos import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return resolve_model(None)  # converted once per machine, then cached under ~/.cache/pdserve


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with the default model's real tokenizer and vocabulary."""
    return _tiny_llama(default_model_dir, tmp_path_factory.mktemp("tiny-llama"), layers=2)


@pytest.fixture(scope="session")
def deep_tiny_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 200 layers: a KV stream of 400 tensors, long enough to be cut in the middle."""
    return _tiny_llama(default_model_dir, tmp_path_factory.mktemp("deep-tiny-llama"), layers=200)


def _tiny_llama(tokenizer_dir: Path, path: Path, layers: int) -> Path:
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start_cluster(model_dir: Path, prefill: int = 1, decode: int = 1, decode_args: tuple[str, ...] = (),
                  prefill_args: tuple[str, ...] = (), colocate_below: int = 0,
                  gateway_args: tuple[str, ...] = (), tls_dir: str = "", dtype: str = "float32") -> Cluster:
    """float32 unless asked: most tests compare tokens with Hugging Face `generate` in float32."""
    return start(ClusterConfig(prefill=prefill, decode=decode, model=str(model_dir), threads=1, dtype=dtype,
                               decode_args=decode_args, prefill_args=prefill_args, startup_timeout_s=180,
                               colocate_below=colocate_below, gateway_args=gateway_args, tls_dir=tls_dir))


@pytest.fixture(scope="session")
def tiny_cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=2, decode_args=("--max-seqs=4", "--lease=3"))
    yield cluster
    cluster.stop()


def worker_infos(cluster: Cluster, prefill: bool = True) -> list[worker_pb2.WorkerInfo]:
    infos = []
    for services, stub_class in ((cluster.prefill if prefill else [], prefill_pb2_grpc.PrefillStub),
                                 (cluster.decode, decode_pb2_grpc.DecodeStub)):
        for service in services:
            with cluster.channel(service) as channel:  # with the client certificate under mutual TLS
                infos.append(stub_class(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5))
    return infos


def held(info: worker_pb2.WorkerInfo) -> tuple[int, int, int, int]:
    return info.live_reservations, info.live_sequences, info.live_kv_bytes, info.live_buffer_bytes


def assert_nothing_held(cluster: Cluster, within_s: float = 2.0, prefill: bool = True) -> None:
    """Every worker's live reservations, sequences, KV bytes and transfer buffers return to zero in `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        infos = worker_infos(cluster, prefill)
        if all(held(info) == (0, 0, 0, 0) for info in infos):
            return
        if time.monotonic() > deadline:
            raise AssertionError("still held (reservations, sequences, kv bytes, buffer bytes): "
                                 + ", ".join(f"{i.role} pid {i.pid}: {held(i)}" for i in infos))
        time.sleep(0.05)
