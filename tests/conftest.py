"""Shared fixtures: the real tokenizer, a tiny random model that uses it, the models loaded in-process, clusters of
real processes, and the leak check after each test of a module that asks for it. Plain helpers are in helpers.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_runner.loading import LoadedModel, ModelConfig, resolve_model
from pdserve.cluster import Cluster
from tests.helpers import assert_nothing_held, start_cluster


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


@pytest.fixture(scope="session")
def long_tiny_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a context of 8,192 tokens: streams long enough to fill a socket's buffers."""
    return _tiny_llama(default_model_dir, tmp_path_factory.mktemp("long-tiny-llama"), layers=2, positions=8192)


def _tiny_llama(tokenizer_dir: Path, path: Path, layers: int, positions: int = 512) -> Path:
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = start_cluster(tiny_model_dir, prefill=1, decode=2, decode_args=("--max-seqs=4", "--lease=3"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def runner(default_model_dir: Path) -> LoadedModel:
    """The real model in-process, float32: a tiny random one repeats one token whatever its KV holds, and would
    hide corruption; its first tokens depend on every position of the prompt's KV."""
    torch.set_num_threads(1)
    return ModelConfig(model=str(default_model_dir), dtype="float32").load()


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model in-process, float32: for tests of the engine's bookkeeping, where the tokens do not matter."""
    torch.set_num_threads(1)
    return ModelConfig(model=str(tiny_model_dir), dtype="float32").load()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "leak_check(cluster): after each test, the named cluster fixture's workers "
                            "hold nothing (tests.helpers.assert_nothing_held)")


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """The leak check after every test of a module marked `pytestmark = pytest.mark.leak_check("<cluster fixture>")`:
    no reservation, sequence, KV byte or transfer buffer left on any worker of that cluster."""
    marker = request.node.get_closest_marker("leak_check")
    cluster: Cluster | None = request.getfixturevalue(marker.args[0]) if marker else None
    yield
    if cluster is not None:
        assert_nothing_held(cluster)
