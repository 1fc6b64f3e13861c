"""Protobuf <-> the plain types of protos/types.py, for the messages both worker pools share. The servicers call
these; below them code sees plain types only."""

from __future__ import annotations

from protos import worker_pb2
from protos.types import ModelSpec, SamplingParams


def sampling_from_pb(message: worker_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field that is out of range."""
    return SamplingParams(temperature=message.temperature, top_p=message.top_p, top_k=message.top_k,
                          seed=message.seed)


def sampling_to_pb(params: SamplingParams) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                     seed=params.seed)


def model_info(spec: ModelSpec) -> worker_pb2.ModelInfo:
    return worker_pb2.ModelInfo(
        name=spec.name, fingerprint=spec.fingerprint, dtype=spec.dtype, num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
        max_model_len=spec.max_model_len, eos_token_ids=list(spec.eos_token_ids),
    )
