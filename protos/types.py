"""The plain values the worker contract (worker.proto) carries, and the rules both sides apply to them.

The gateway and the workers import these without torch: sampling parameters and their ranges, the model a worker
serves, and the names of a prompt's prefix blocks (the gateway routes by them, prefill caches by them; the block
size comes from WorkerInfo.prefix_block_tokens). protos/convert.py turns them into messages and back, at the
servicers; below the servicers code sees these, never protobuf.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

# OpenAI's documented range for `temperature`. vLLM has no upper bound; above 2 the distribution is close to
# uniform over whatever top_k/top_p keep, which no client means to ask for.
MAX_TEMPERATURE = 2.0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # the compute and KV dtypes a worker serves, by name
# A cache_salt names a prefix-cache namespace (block_names); the cap bounds what one request adds to each hash.
MAX_CACHE_SALT_CHARS = 256
# A time-per-token target past a minute asks for nothing a stream could use (gateway Slo.tpot_ms, decode's
# DecodeRequest.tpot_target_ms).
MAX_TPOT_TARGET_MS = 60_000


def check_cache_salt(salt: str) -> None:
    """The one cache_salt rule, for the gateway and the workers alike: at most MAX_CACHE_SALT_CHARS printable
    characters ("" is no salt)."""
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt is {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS} are accepted")
    if not salt.isprintable():  # it may reach a log line: no newline to forge one
        raise ValueError("cache_salt may hold printable characters only")


def check_temperature(temperature: float) -> None:
    """The one temperature rule, for the gateway's front doors and the workers alike: [0, 2]; 0 is greedy."""
    if not 0 <= temperature <= MAX_TEMPERATURE:  # NaN too
        raise ValueError(f"temperature = {temperature} is outside [0, {MAX_TEMPERATURE:g}]")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below model_runner.sampling.SAMPLING_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError naming the field that is out of range."""
        check_temperature(self.temperature)
        if not 0 < self.top_p <= 1:  # NaN too
            raise ValueError(f"top_p = {self.top_p} is outside (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0")


@dataclass(frozen=True)
class ModelSpec:
    """What a worker serves; workers pair only when `fingerprint` matches."""

    name: str
    fingerprint: str
    dtype: str  # a key of DTYPE_BYTES
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


def block_names(tokens: Sequence[int], block_tokens: int, salt: bytes | str = b"") -> list[bytes]:
    """The chained name of each full block of `tokens`: block i's name hashes block i-1's name and block i's
    tokens (as native int64), so a name stands for the whole prefix up to and including that block. A `salt` (the
    request's cache_salt) seeds the chain, so no name under one salt equals a name under another: prefixes are
    shared only within a salt. The empty salt seeds nothing."""
    if isinstance(salt, str):
        salt = salt.encode()
    names, previous = [], xxhash.xxh3_128_digest(b"pdserve-cache-salt\0" + salt) if salt else b""
    ids = array("q", tokens)
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        previous = xxhash.xxh3_128_digest(previous + ids[start : start + block_tokens].tobytes())
        names.append(previous)
    return names
