"""The decode worker's settings, written once (serving/settings.py): flags, environment and config file."""

from __future__ import annotations

from dataclasses import dataclass

from engine.settings import WorkerSettings
from kv_wire.layout import MAX_CHUNK_BYTES
from model_runner.loading import ModelConfig
from protos.types import ModelSpec
from serving.server import MAX_MESSAGE_BYTES, ServerConfig
from serving.settings import check_settings, setting

DEFAULT_KV_BUDGET_MB = 2048  # the paged KV cache: 64 sequences of ~700 tokens of the default model in fp32


@dataclass(frozen=True)
class DecodeConfig(WorkerSettings):
    server: ServerConfig
    model: ModelConfig
    max_seqs: int = setting(64, "sequences decoded at once", low=1)
    kv_budget_mb: float = setting(
        0.0, f"KV memory reservations may draw on: the paged KV cache's size (0: {DEFAULT_KV_BUDGET_MB} MiB, or less "
        "if --max-seqs sequences at full context need less)", low=0)
    lease_s: float = setting(
        30.0, "seconds a reservation waits for its KV with no word from the prefill worker (a renewal while the "
        "prompt is queued, a KV message once it streams)", flag="--lease", above=0)
    max_chunk_bytes: int = setting(MAX_CHUNK_BYTES, "largest KV chunk accepted", above=0, high=MAX_MESSAGE_BYTES // 2)
    # lend shared-memory segments, so a prefill worker on this host skips the wire
    kv_shm: bool = setting(True, "lend no shared-memory segments: every KV byte comes over gRPC", flag="--no-kv-shm")
    # Colocated prompts: most tokens prefilled between two decode steps. 32 tokens are ~40 ms of bf16 prefill on one
    # core with AMX; where a chunk takes longer (~100 ms on an AVX2-only EPYC), --prefill-pass-ms pauses it at a
    # layer boundary for a decode step, so a running stream waits about a step plus 35 ms at most
    # (docs/benchmarks.md, "serve"). A worker with no prefill tier beside it prefills whole prompts: `pdserve
    # cluster --prefill 0` gives it 256.
    prefill_chunk: int = setting(
        32, "colocated prompts: longer ones are prefilled in passes of this many tokens between two decode steps",
        low=1)
    prefill_batch_tokens: int = setting(
        256, "colocated short prompts share one pass while the padded batch holds at most this many tokens", low=1)
    prefill_pass_ms: float = setting(
        35.0, "colocated prompts: while streams run, a prompt pass that has run this many ms since the last decode "
        "step pauses at its next layer boundary for one, so a stream waits about a step plus this for its next "
        "token; 0: passes run whole", low=0)
    prefill_pass_steps: float = setting(
        1.25, "colocated prompts: the pause comes sooner, once the pass has run this many decode steps (their "
        "recent mean) if that is less than --prefill-pass-ms, so on a fast machine a stream's slowest token "
        "interval stays near 1 + this many steps; 0: --prefill-pass-ms alone", low=0)
    prefill_busy_steps: float = setting(
        2.0, "colocated prompts: while those queued here would take more than --prefill-busy-ms to prefill, a pass "
        "may run this many decode steps before one (if more than the budget above), so this core takes most of a "
        "prompt backlog's work while its streams wait about 1 + this many steps per token; 0: off", low=0)
    prefill_busy_ms: float = setting(
        1000.0, "colocated prompts: the backlog, in predicted ms of passes, past which --prefill-busy-steps applies",
        low=0)
    buffer_keep_mb: float = setting(
        1024.0, "idle shared-memory KV segments kept warm for later requests", flag="--kv-buffer-keep-mb", low=0)
    kv_warm_mb: float = setting(
        1024.0, "KV cache memory committed at startup, so joining sequences do not stall the batch on page faults",
        low=0)
    kv_port: int = setting(
        -1, "serve TransferKV (the KV stream from prefill) on this port of its own, so a network policy can open it "
        "to prefill workers only; 0 picks a free one; -1 serves it on --port", low=-1, high=65535)

    def kv_budget_bytes(self, spec: ModelSpec) -> int:
        """What reservations may draw on: --kv-budget-mb, or the default capped by --max-seqs full contexts."""
        budget = int((self.kv_budget_mb or DEFAULT_KV_BUDGET_MB) * (1 << 20))
        return budget if self.kv_budget_mb else min(self.max_seqs * spec.max_model_len * spec.kv_bytes_per_token,
                                                    budget)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.kv_port > 0 and self.kv_port == self.server.port:
            raise ValueError(f"--kv-port {self.kv_port}: expected -1 (the main port), 0 (a free one) or a port "
                             "other than --port")
