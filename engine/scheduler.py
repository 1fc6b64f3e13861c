"""Which prompts the next prompt pass runs, in either role (a prefill worker, or colocated prompts on decode).

Two kinds of pass:
- a batch of short prompts (at most one chunk each), right-padded into one pass while the padded batch stays
  within `batch_tokens`: one core reads the weights once for all of them, which pays for short prompts and
  stops paying past ~128 tokens, so the default is 256 (docs/architecture.md, "Why these numbers");
- the next chunk of at most `chunk_tokens` of the oldest long prompt.
When both kinds wait they take turns: a short prompt waits at most one chunk behind a long one, and a stream of
short prompts never starves a long one.
"""

from __future__ import annotations

import collections
from typing import Generic, Protocol, TypeVar

MAX_BATCH = 16  # prompts in one batched pass


class Prompt(Protocol):
    @property
    def token_ids(self) -> list[int]: ...

    @property
    def abandoned(self) -> bool: ...

    @property
    def done(self) -> int: ...  # prompt tokens already in the prompt's cache (earlier chunks, or a cached prefix)

    @property
    def decoded(self) -> int: ...  # trailing tokens that decode steps generated (engine/prompts.py)


P = TypeVar("P", bound=Prompt)


class PromptScheduler(Generic[P]):
    """Pure bookkeeping: no model, no threads (its engine holds the lock)."""

    def __init__(self, batch_tokens: int, chunk_tokens: int) -> None:
        self.batch_tokens, self.chunk_tokens = batch_tokens, chunk_tokens
        self.short: collections.deque[P] = collections.deque()
        self.long: collections.deque[P] = collections.deque()  # long[0] may be part-way through
        self._long_turn = False

    def is_long(self, job: P) -> bool:
        """Runs alone, continuing its own cache: longer than a chunk, starting after a cached prefix, or holding
        decoded tokens (replayed in passes of their own)."""
        return job.done > 0 or job.decoded > 0 or len(job.token_ids) > self.chunk_tokens

    def add(self, job: P) -> None:
        (self.long if self.is_long(job) else self.short).append(job)

    def __len__(self) -> int:
        return len(self.short) + len(self.long)

    def waiting(self) -> list[P]:
        return [*self.short, *self.long]

    def drop_abandoned(self) -> list[P]:
        dropped = [job for job in self.waiting() if job.abandoned]
        for queue in (self.short, self.long):
            kept = [job for job in queue if not job.abandoned]
            queue.clear()
            queue.extend(kept)
        return dropped

    def next_pass(self) -> list[P]:
        """A batch of short prompts (removed from the queue), or [the oldest long prompt] (left at its head until
        its last chunk ran: `finished_long` removes it). Empty when nothing waits."""
        if self.long and (not self.short or self._long_turn):
            self._long_turn = False
            return [self.long[0]]
        self._long_turn = bool(self.long)
        batch: list[P] = []
        longest = 0
        for job in list(self.short):
            widest = max(longest, len(job.token_ids))
            if batch and (len(batch) == MAX_BATCH or widest * (len(batch) + 1) > self.batch_tokens):
                continue  # a later, shorter prompt may still fit
            batch.append(job)
            longest = widest
            self.short.remove(job)
        return batch

    def finished_long(self, job: P) -> None:
        if job in self.long:
            self.long.remove(job)
