"""Streaming text: incremental detokenization that never splits a character, and stop strings."""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the output, so the first token's leading space survives


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of ids twice, with and without the newest ones, and emits the difference only once
    it no longer ends in U+FFFD: a byte-level token can hold half of a multi-byte character.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds stop strings across deltas; holds back any tail that could still become one."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, the text ends before it."""
        if not self._stops:
            return text, False
        pending = self._held + text
        hits = [i for i in (pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return pending[: min(hits)], True
        keep = max((k for s in self._stops for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
