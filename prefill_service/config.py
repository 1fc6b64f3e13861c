"""The prefill worker's settings, written once (serving/settings.py): flags, environment and config file."""

from __future__ import annotations

from dataclasses import dataclass

from engine.settings import WorkerSettings
from kv_wire.layout import DEFAULT_CHUNK_BYTES, LOSSY_WIRE_DTYPES
from model_runner.loading import ModelConfig
from serving.server import (
    MAX_MESSAGE_BYTES,
    ServerConfig,
)
from serving.settings import check_settings, setting


@dataclass(frozen=True)
class PrefillConfig(WorkerSettings):
    server: ServerConfig
    model: ModelConfig
    chunk_bytes: int = setting(DEFAULT_CHUNK_BYTES, "KV bytes per transfer message", above=0,
                               high=MAX_MESSAGE_BYTES // 2)
    wire_dtype: str = setting("", "send float32 KV as bfloat16 or float16: half the bytes, lossy",
                              choices=("", *LOSSY_WIRE_DTYPES), default_text="the model's dtype, exact")
    kv_shm: bool = setting(True, "never use a decode worker's shared-memory segment: send every KV byte over gRPC",
                           flag="--no-kv-shm")  # on: write KV into a segment decode lent, when it is on this host
    layer_streaming: bool = setting(
        True, "send the KV after the whole forward pass instead of layer by layer (a baseline)",
        flag="--no-layer-streaming")
    prefill_chunk: int = setting(
        256, "prompts longer than this run in passes of this many tokens, taking turns with short prompts", low=1)
    batch_tokens: int = setting(
        256, "short prompts share one forward pass while the padded batch holds at most this many tokens",
        flag="--prefill-batch-tokens", low=1)
    max_queued_tokens: int = setting(
        65536, "prompt tokens waiting or running; a prompt beyond it is refused with RESOURCE_EXHAUSTED", low=1)
    prefix_cache_mb: float = setting(
        512.0, "KV of prompt prefixes kept for reuse, so a prompt that starts like an earlier one only computes the "
        "rest; least recently used evicted first; 0 turns it off", low=0)
    prefix_block_tokens: int = setting(16, "prefixes are cached and matched in blocks of this many tokens", low=1)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.wire_dtype and self.model.dtype != "float32":
            raise ValueError(f"--wire-dtype {self.wire_dtype!r}: only {' or '.join(LOSSY_WIRE_DTYPES)}, "
                             "and only for a float32 model")
