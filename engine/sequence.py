"""A request as the decode batch sees it: its tokens so far, its KV blocks, and where its tokens go."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from protos.types import SamplingParams

# emit(new_token_ids, finish_reason): called from the engine thread; finish_reason "" while running, FAILED
# when the engine could not continue the sequence.
Emit = Callable[[list[int], str], None]
FAILED = "error"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    emit: Emit
    tokens: list[int] = field(default_factory=list)  # generated so far; tokens[0] came from its prompt pass
    blocks: list[int] = field(default_factory=list)  # its KV blocks in the engine's cache, while it runs
    # Set by EngineCore.abort: this object, never a later request with the same id. A colocated prompt's pass
    # watches it too, so an abort stops the pass at its next layer boundary.
    abandon: threading.Event = field(default_factory=threading.Event)
    # For its trace, when traced: (start, end, batch size) of every step it rode in (perf_counter), and when it
    # was handed to the engine and when it joined the batch.
    steps: list[tuple[float, float, int]] | None = None
    submitted_at: float = 0.0
    joined_at: float = 0.0
    tpot_target_s: float = 0.0  # the time between tokens it asks for (0: none): bounds colocated passes' budget

    @property
    def aborted(self) -> bool:
        return self.abandon.is_set()

    @property
    def cached(self) -> int:
        """Positions in the KV cache: the prompt and every generated token but the last (the next input)."""
        return self.prompt_len + len(self.tokens) - 1

    def finish_reason(self, max_model_len: int) -> str:
        if self.tokens[-1] in self.stop_token_ids:
            return "stop"
        if len(self.tokens) >= self.max_tokens or self.cached + 1 >= max_model_len:
            return "length"
        return ""
