"""Streaming text: incremental detokenization that never splits a character, and stop strings."""

from __future__ import annotations

import collections
import os
from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the output, so the first token's leading space survives
# Adds a text may be held for. A character is at most 4 UTF-8 bytes and a byte-level token holds at least one, so a
# character split across tokens is whole within 4 of them. Text still unfinished after that (lone bytes, broken
# UTF-8) goes out as it decodes, U+FFFD included: the window stays a few tokens long, so any sequence of tokens costs
# time linear in its length.
_MAX_HELD = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of ids, the tokens of the last delta (for context) and those since, and emits what the
    newest ones add once it no longer ends in U+FFFD: a byte-level token can hold half of a multi-byte character.
    After `_MAX_HELD` adds the text goes out anyway, all but a last U+FFFD, which the next tokens may still finish
    as a character; so the deltas join to what a whole decode gives.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        # special tokens, whose text the decode skips: kept out of the window, so they hold nothing up
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._skipped = frozenset(i for i, token in added.items() if getattr(token, "special", False))
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix = self._decode(self._ids)  # the text of ids[prefix_offset:read_offset]
        self._emitted = len(self._prefix)  # how much of it is out: all, or all but a last U+FFFD
        self._held_adds = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token_ids: list[int]) -> str:
        token_ids = [token for token in token_ids if token not in self._skipped]
        if not token_ids:  # done, unless half a character is held before them
            return ""
        self._ids.extend(token_ids)
        full = self._decode(self._ids[self._prefix_offset :])
        if full == self._prefix and not full.endswith("\ufffd"):  # other tokens without text: done, and dropped
            del self._ids[self._read_offset :]
            self._held_adds = 0
            return ""
        self._held_adds += 1
        if len(full) < self._emitted or full.endswith("\ufffd"):
            if self._held_adds <= _MAX_HELD:
                return ""
            return self._emit(full, keep_last=full.endswith("\ufffd"))
        return self._emit(full, keep_last=False)

    def _emit(self, full: str, keep_last: bool) -> str:
        """What `full` adds to the text out so far; the window then starts at the tokens just read."""
        out = self._prefix[: self._emitted]
        start = len(out) if full.startswith(out) else len(os.path.commonprefix([out, full]))
        end = len(full) - keep_last
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix = self._decode(self._ids[self._prefix_offset :])
        self._emitted = len(self._prefix) - keep_last
        self._held_adds = 0
        return full[start:end]

    @property
    def holding(self) -> bool:
        """Whether the newest tokens' text is still held back (half a character)."""
        return self._read_offset < len(self._ids)

    def flush(self) -> str:
        """The text still held back, once no token follows: a character the last token left unfinished comes out
        as U+FFFD, as a whole decode would show it."""
        if not self.holding and self._emitted == len(self._prefix):
            return ""
        return self._emit(self._decode(self._ids[self._prefix_offset :]), keep_last=False)


class StopMatcher:
    """Finds stop strings across deltas; holds back any tail that could still become one.

    An Aho-Corasick automaton over the stop strings, fed one character at a time. Its state is the longest tail of
    the text so far that begins some stop string: that tail is what is held back. So a feed costs O(len(text)) and
    O(longest stop) at most to carry the held tail, however many and however long the stops are; building costs
    O(their total length) once. The text ends before the first stop string to end (the longest, if several end on
    the same character), wherever the deltas were cut.
    """

    def __init__(self, stops: list[str]) -> None:
        self._next: list[dict[str, int]] = [{}]  # state -> character -> state (the trie's edges)
        self._depth = [0]  # characters of the stop prefix a state stands for: the held tail's length
        self._ends = [0]  # the longest stop string that ends at a state, 0 if none
        for stop in filter(None, stops):
            state = 0
            for char in stop:
                if char not in self._next[state]:
                    self._next[state][char] = len(self._next)
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._ends.append(0)
                state = self._next[state][char]
            self._ends[state] = len(stop)
        self._fail = [0] * len(self._next)  # the longest proper suffix of a state's prefix that is a state too
        breadth_first = collections.deque(self._next[0].values())
        while breadth_first:
            state = breadth_first.popleft()
            for char, child in self._next[state].items():
                self._fail[child] = self._step(self._fail[state], char)
                self._ends[child] = max(self._ends[child], self._ends[self._fail[child]])
                breadth_first.append(child)
        self._state = 0
        self._held = ""

    def _step(self, state: int, char: str) -> int:
        while state and char not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(char, 0)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, the text ends before it."""
        if len(self._next) == 1:
            return text, False
        pending = self._held + text
        state = self._state
        for end, char in enumerate(text, start=len(self._held) + 1):
            state = self._step(state, char)
            if self._ends[state]:
                self._state, self._held = 0, ""
                return pending[: end - self._ends[state]], True
        self._state = state
        keep = self._depth[state]
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held


class TextStream:
    """One request's generated tokens in, the client's pieces out: text cut before the first stop string, each
    piece with the token ids of its text.

    A token id goes out with the last of its text, so a piece's text is the text of its ids (gateway.proto), and
    a token that is still held back (half a character, or a tail that may begin a stop string) is held with it.
    A token without text (a special one, skipped) goes out at once, with empty text, unless text before it is held.
    When a stop string ends generation, the text ends where it begins, and only the tokens whose text ends there
    or before go out: none of the stop string's tokens, though one that straddles its start lends its head to the
    text. The last piece flushes everything else (`last`), so no text is lost at the end. Tokens are taken one at
    a time, so none of this depends on how the workers batched them.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopMatcher(stops)
        self.consumed = 0  # tokens read; after a stop string, those up to the one that completes it
        self._undecoded: list[int] = []  # tokens whose text the detokenizer still holds
        # tokens whose text is decoded, with where it ends: characters from the start of the output
        self._decoded: collections.deque[tuple[int, int]] = collections.deque()
        self._decoded_chars = 0
        self._safe = ""  # text past the stop matcher, held until its tokens can go with it
        self._sent_chars = 0

    def add(self, token_ids: list[int], last: bool) -> tuple[str, list[int], bool]:
        """Returns (text, its token ids, whether a stop string was hit). After a hit nothing more follows."""
        stopped = False
        for token in token_ids:
            self.consumed += 1
            self._undecoded.append(token)
            delta = self._detokenizer.add([token])
            stopped = self._feed(delta, done=not self._detokenizer.holding)
            if stopped:
                break
        if last and not stopped:
            stopped = self._feed(self._detokenizer.flush(), done=True)
            if not stopped:
                self._safe += self._stops.flush()
        safe_end = self._sent_chars + len(self._safe)
        ids, end = [], self._sent_chars
        while self._decoded and self._decoded[0][1] <= safe_end:
            token, end = self._decoded.popleft()
            ids.append(token)
        text = self._safe if stopped or last else self._safe[: end - self._sent_chars]
        self._safe = self._safe[len(text) :]
        self._sent_chars += len(text)
        return text, ids, stopped

    def _feed(self, delta: str, done: bool) -> bool:
        if done:  # the tokens held so far end together: the delta is the text of all of them
            self._decoded_chars += len(delta)
            self._decoded.extend((token, self._decoded_chars) for token in self._undecoded)
            self._undecoded = []
        safe, stopped = self._stops.feed(delta)
        self._safe += safe
        return stopped
