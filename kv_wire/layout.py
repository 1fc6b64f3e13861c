"""What both ends of a KV transfer agree on: tensor layout, dtypes, states and errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc
import numpy as np
import torch
import xxhash

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOSSY_WIRE_DTYPES = ("bfloat16", "float16")  # opt-in downcasts of float32 KV; the receiver casts back
# 768 KiB: far under gRPC's 4 MiB message limit, large enough to amortise framing, and under 1 MiB: on the
# reference machine, messages of 1 MiB and more cost grpcio more per byte at both ends, the raw ceiling included
# (README, "The KV handoff": the real path at 2.8-3.1 GB/s with 1 MiB chunks, 3.3-3.8 GB/s with 768-992 KiB).
DEFAULT_CHUNK_BYTES = 768 << 10
MAX_CHUNK_BYTES = 4 << 20  # the largest chunk a decode worker takes by default: gRPC's default message limit


class TransferState(enum.Enum):
    """Life of one KV stream, the same on both ends (KVSender, KVReceiver). FAILED is final and reported to the
    other end at once. The decode worker's reservation, which outlives its stream, has states of its own
    (decode_service.reservations.ReservationState)."""

    WAITING = "waiting"  # sender: reservation in hand, no KV yet; receiver: reservation made, no header yet
    TRANSFERRING = "transferring"  # header accepted, chunks flowing
    COMPLETE = "complete"  # trailer accepted, every byte verified (receiver) / acknowledged (sender)
    FAILED = "failed"


class KVTransferError(Exception):
    """A refused or broken transfer, with the gRPC status that names its cause."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class KVLayout:
    """Every layer sends KEYS then VALUES, each a C-contiguous (num_kv_heads, num_tokens, head_dim) tensor."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: str

    @property
    def tensor_bytes(self) -> int:
        return self.num_kv_heads * self.num_tokens * self.head_dim * WIRE_DTYPES[self.dtype].itemsize

    @property
    def total_bytes(self) -> int:
        return 2 * self.num_layers * self.tensor_bytes

    @property
    def tensor_shape(self) -> tuple[int, int, int]:
        return (self.num_kv_heads, self.num_tokens, self.head_dim)


def checksum(data: bytes | memoryview | np.ndarray) -> int:
    """XXH3-64 of bytes, a memoryview or a uint8 array, read in place (no copy)."""
    return xxhash.xxh3_64_intdigest(data.data if isinstance(data, np.ndarray) else data)


# Three quarters of the reference machine's 1 MiB L2: each block is hashed while the copy left it in cache.
# A gRPC chunk of the default size is one block.
COPY_BLOCK_BYTES = 768 << 10


def copy_with_checksum(target: np.ndarray, source: np.ndarray) -> int:
    """Copy uint8 `source` into `target` of the same size; returns checksum(target).

    Copying a tensor larger than the cache, then hashing it, reads every byte from memory twice; block by block
    the hash reads what the copy just wrote from cache, and a source of one block or less is copied, then hashed,
    in one go. Smaller blocks cost more calls than they save (docs/architecture.md, "Why these numbers").
    """
    if len(source) <= COPY_BLOCK_BYTES:
        np.copyto(target, source)
        return checksum(target)
    digest = xxhash.xxh3_64()  # the streamed digest of the blocks equals the digest of the whole
    for start in range(0, len(source), COPY_BLOCK_BYTES):
        block = target[start : start + COPY_BLOCK_BYTES]
        np.copyto(block, source[start : start + COPY_BLOCK_BYTES])
        digest.update(block.data)
    return digest.intdigest()
