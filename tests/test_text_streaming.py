"""Incremental detokenization and stop strings, with the real tokenizer."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import gateway.detokenizer
from gateway.detokenizer import IncrementalDetokenizer, StopMatcher, TextStream
from gateway.request import MAX_STOP_CHARS, MAX_STOP_STRINGS


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize(
    "text", ["Hello, world!", "naïve café 東京 🚀🎉 done", "  spaces\n\nand\ttabs  ", "日本語のテキスト"])
def test_token_by_token_deltas_join_to_the_full_text_and_never_split_a_character(tokenizer, text: str) -> None:
    prompt = tokenizer("Say:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([token]) for token in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_emoji_split_across_tokens_is_held_until_whole(tokenizer) -> None:
    ids = tokenizer("🚀", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the rocket emoji spans several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([t]) for t in ids] == [""] * (len(ids) - 1) + ["🚀"]


def test_a_token_without_text_goes_out_at_once_unless_half_a_character_is_held(tokenizer) -> None:
    """A special token (skipped text) is complete: it goes out in its own piece, with empty text, not with the next
    token's text a step later (which looked like a stall of two steps to a streaming client). After half a
    character it waits with it."""
    im_end, im_start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    hello, newline = (tokenizer(t, add_special_tokens=False).input_ids for t in ("Hello", "\n"))
    stream = TextStream(tokenizer, [], [])
    pieces = [stream.add([t], last=False) for t in [*hello, im_end, *newline, im_start]]
    assert pieces[-3:] == [("", [im_end], False), ("\n", newline, False), ("", [im_start], False)]
    rocket = tokenizer("🚀", add_special_tokens=False).input_ids
    cut = TextStream(tokenizer, [], [])
    assert cut.add(rocket[:1], last=False) == ("", [], False)
    assert cut.add([im_end], last=False) == ("", [], False)  # behind half a character: held with it
    assert cut.add(rocket[1:], last=True)[1] == [*rocket[:1], im_end, *rocket[1:]]


def test_stop_string_across_deltas_is_cut_and_not_emitted() -> None:
    stops = StopMatcher(["END"])
    assert stops.feed("abc E") == ("abc ", False)  # "E" might start "END": held back
    assert stops.feed("N") == ("", False)
    assert stops.feed("D and more") == ("", True)


def test_held_text_is_released_when_it_cannot_become_a_stop() -> None:
    stops = StopMatcher(["END"])
    assert stops.feed("xE") == ("x", False)
    assert stops.feed("x") == ("Ex", False)
    assert stops.flush() == ""
    stops.feed("tail E")
    assert stops.flush() == "E"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcEND \n", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6),
       stop=st.sampled_from(["END", "\n\n", "a"]))
def test_stop_matcher_equals_cutting_the_whole_text(text: str, cuts: list[int], stop: str) -> None:
    stops = StopMatcher([stop])
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    out, hit = "", False
    for start, end in zip(bounds, bounds[1:]):
        emitted, hit = stops.feed(text[start:end])
        out += emitted
        if hit:
            break
    if not hit:
        out += stops.flush()
    expected = text[: text.index(stop)] if stop in text else text
    assert (out, hit) == (expected, stop in text)


def _first_to_end(text: str, stops: list[str]) -> tuple[str, bool]:
    """The whole text cut before the first stop string to end in it (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        ending = [len(stop) for stop in stops if text[:end].endswith(stop)]
        if ending:
            return text[: end - max(ending)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abcd", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="abcd", min_size=1, max_size=5), min_size=1, max_size=4))
def test_overlapping_stops_end_at_the_first_to_end_however_the_text_is_cut(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    matcher = StopMatcher(stops)
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    out, hit = "", False
    for start, end in zip(bounds, bounds[1:]):
        emitted, hit = matcher.feed(text[start:end])
        out += emitted
        if hit:
            break
    if not hit:
        out += matcher.flush()
    assert (out, hit) == _first_to_end(text, stops)


def test_the_longest_tail_that_may_begin_any_stop_is_held_back() -> None:
    stops = StopMatcher(["abcX", "bcY", "cZ"])
    assert stops.feed("zab") == ("z", False)  # "ab" may begin abcX
    assert stops.feed("c") == ("", False)  # "abc" may begin abcX, "bc" bcY, "c" cZ: all held
    assert stops.feed("Y!") == ("a", True)  # bcY: the "a" it held for abcX is released


def _lines_run(work: Callable[[], object]) -> int:
    """Lines of gateway/detokenizer.py executed while `work` runs: the matcher's work counted, not timed."""
    lines = 0
    module = gateway.detokenizer.__file__

    def count(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal lines
        if frame.f_code.co_filename != module:
            return None
        lines += event == "line"
        return count

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        work()
    finally:
        sys.settrace(previous)
    return lines


def test_a_feed_costs_the_same_whatever_the_stop_strings_length() -> None:
    """The matcher used to slice every prefix of every stop string on every feed: one request's 300,000-character
    stop held the gateway's event loop for seconds. Now 1000 one-character deltas cost as many lines of work
    against 16 stops at the length cap, their longest prefix held back throughout, as against one short stop."""

    def work(stops: list[str]) -> tuple[int, int]:
        matcher: StopMatcher | None = None

        def build() -> None:
            nonlocal matcher
            matcher = StopMatcher(stops)

        built = _lines_run(build)
        assert matcher is not None
        emitted: list[tuple[str, bool]] = []
        fed = _lines_run(lambda: emitted.extend(matcher.feed("a") for _ in range(1000)))  # type: ignore[union-attr]
        emitted.append(matcher.feed("b"))
        longest = max(map(len, stops))
        assert "".join(text for text, _ in emitted) == "a" * (1001 - longest)  # the longest stop ends here
        assert [hit for _, hit in emitted] == [False] * 1000 + [True]
        return built, fed

    _, short = work(["a" * 9 + "b"])
    longest = ["a" * (MAX_STOP_CHARS - 1 - i) + "b" for i in range(MAX_STOP_STRINGS)]
    built, at_cap = work(longest)
    assert at_cap <= 1.2 * short and at_cap < 20 * 1000  # the old matcher: ~1500 lines a feed at the cap
    assert built < 20 * sum(map(len, longest))  # building is linear in the stops' characters


def test_the_last_piece_carries_the_text_still_held(tokenizer) -> None:
    """A batch whose text ends in half a character was held whole, and at the finish it was never flushed: the
    client lost "Done." here. Now the last piece carries it, the cut character as U+FFFD, as a whole decode."""
    ids = tokenizer("Done. 🚀", add_special_tokens=False).input_ids[:-1]  # the rocket cut before its last byte
    assert tokenizer.decode(ids).endswith("\ufffd")
    stream = TextStream(tokenizer, tokenizer("Say:").input_ids, [])
    assert stream.add(ids, last=True) == (tokenizer.decode(ids), ids, False)
    held = IncrementalDetokenizer(tokenizer, [])
    assert held.add(ids) == "" and held.flush() == tokenizer.decode(ids)


def test_a_stop_string_s_tokens_are_not_returned(tokenizer) -> None:
    words = ["Hello", " world", ",", " the", " END", " of", " it"]
    ids = [tokenizer(w, add_special_tokens=False).input_ids[0] for w in words]
    stream = TextStream(tokenizer, [], [" END"])
    pieces = [stream.add([t], last=i == len(ids) - 1) for i, t in enumerate(ids[:5])]
    assert pieces[-1][2], "the stop string was hit"
    assert "".join(text for text, _, _ in pieces) == "Hello world, the"
    assert [t for _, got, _ in pieces for t in got] == ids[:4]  # " END"'s token stays out
    assert stream.consumed == 5
    batched = TextStream(tokenizer, [], [" END"])  # in one batch, with tokens after the stop: the same
    assert batched.add(ids, last=True) == ("Hello world, the", ids[:4], True) and batched.consumed == 5
    # a token that straddles the stop's start lends its head to the text, not its id
    straddle = TextStream(tokenizer, [], ["ld,"])
    pieces = [straddle.add([t], last=False) for t in ids[:3]]
    assert "".join(text for text, _, _ in pieces) == "Hello wor" and pieces[-1][2]
    assert [t for _, got, _ in pieces for t in got] == ids[:1]


# Tokens that make stops, split characters (the rocket's three bytes) and a special token (2: skipped text).
_PIECES = ["a", "b", " END", "é", "🚀", "\n", " the"]


@settings(max_examples=300, deadline=None)
@given(picks=st.lists(st.integers(0, len(_PIECES)), min_size=1, max_size=24),
       cuts=st.lists(st.integers(0, 60), max_size=8),
       stops=st.lists(st.sampled_from(["END", "b E", "🚀", "\n\n", "aé", "x"]), max_size=3))
def test_pieces_join_to_the_cut_text_and_carry_exactly_their_tokens(tokenizer, picks: list[int], cuts: list[int],
                                                                     stops: list[str]) -> None:
    """However the tokens are batched: the text is the whole decode cut before the first stop to end; each piece's
    token ids are the tokens of the text so far; the tokens that go out never hold stop text; without a stop,
    every token goes out; and what goes out is what goes out when the tokens come one by one."""
    ids = []
    for pick in picks:
        ids += [2] if pick == len(_PIECES) else tokenizer(_PIECES[pick], add_special_tokens=False).input_ids
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    expected, hits = _first_to_end(whole, stops) if stops else (whole, False)
    stream = TextStream(tokenizer, [], stops)
    bounds = sorted({0, len(ids), *[min(c, len(ids)) for c in cuts]})
    text, sent, stopped = "", [], False
    for start, end in zip(bounds, bounds[1:]):
        piece, piece_ids, stopped = stream.add(ids[start:end], last=end == len(ids))
        text += piece
        sent += piece_ids
        if stopped:
            break
        assert tokenizer.decode(sent, skip_special_tokens=True) == text  # a piece's text is its tokens' text
    assert (text, stopped) == (expected, hits)
    assert sent == ids[: len(sent)]
    one_by_one, pieces = TextStream(tokenizer, [], stops), []
    for i, token in enumerate(ids):
        pieces.append(one_by_one.add([token], last=i == len(ids) - 1))
        if pieces[-1][2]:
            break
    assert ("".join(p[0] for p in pieces), [t for p in pieces for t in p[1]]) == (text, sent)
    assert stream.consumed == one_by_one.consumed == len(pieces)
    assert text.startswith(tokenizer.decode(sent, skip_special_tokens=True))
    if not hits:
        assert sent == ids


def _deltas(tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    """One token at a time, then the flush: what a stream sends."""
    detok = IncrementalDetokenizer(tokenizer, prompt or [])
    return [detok.add([token]) for token in ids] + [detok.flush()]


def _stream(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    stream = TextStream(tokenizer, [], [])
    pieces = [stream.add([token], last=i == len(ids) - 1) for i, token in enumerate(ids)]
    return "".join(text for text, _, _ in pieces), [token for _, got, _ in pieces for token in got]


LONE_BYTE = 187  # "ð": the byte 0xF0, which begins a 4-byte character, on its own


@pytest.mark.parametrize("text", ["👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "👩🏽‍💻 coder", "日本語のテキスト",
                                  "中文测试：天气很好。", "한국어 텍스트", "𣯩𪈗 rare", "🚀🎉🔥💯🥳🤖👾"])
def test_emoji_zwj_sequences_and_cjk_come_out_whole(tokenizer, text: str) -> None:
    """Characters split across 2 to 4 byte-level tokens (a rare CJK character takes four one-byte tokens), in
    emoji, ZWJ sequences and CJK: never cut, and the deltas join to the whole decode."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas = _deltas(tokenizer, ids, tokenizer("Say:").input_ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert _stream(tokenizer, ids) == (text, ids)


def test_a_four_byte_character_in_four_one_byte_tokens_is_held_until_whole(tokenizer) -> None:
    ids = tokenizer("𣯩", add_special_tokens=False).input_ids
    assert len(ids) == 4 and ids[0] == LONE_BYTE
    assert _deltas(tokenizer, ids) == ["", "", "", "𣯩", ""]


def _broken(tokenizer) -> dict[str, list[int]]:
    rocket = tokenizer("🚀", add_special_tokens=False).input_ids  # ["\xf0\x9f", "\x9a", "\x80"]
    rare = tokenizer("𣯩", add_special_tokens=False).input_ids  # four one-byte tokens
    word = tokenizer(" ok", add_special_tokens=False).input_ids
    return {
        "lone bytes": [LONE_BYTE] * 40,
        "lone bytes then text": [LONE_BYTE] * 9 + word,
        "continuation bytes alone": rocket[1:] * 10 + word,
        "a character cut short by text": rocket[:2] + word + rare[:3] + word,
        "a start byte before a whole character": [LONE_BYTE] * 6 + rocket + word,
        "lone bytes that end in a character": [LONE_BYTE] * 7 + rare[1:] + word,
        "a character begun as lone bytes run long": [LONE_BYTE] * 3 + rare + word,  # no longer held at its 2nd byte
        "ends in half a character": word + [LONE_BYTE] * 6 + rare[1:3],
    }


@pytest.mark.parametrize("case", ["lone bytes", "lone bytes then text", "continuation bytes alone",
                                  "a character cut short by text", "a start byte before a whole character",
                                  "lone bytes that end in a character", "a character begun as lone bytes run long",
                                  "ends in half a character"])
def test_lone_bytes_and_broken_utf8_come_out_as_the_whole_decode_shows_them(tokenizer, case: str) -> None:
    """Broken UTF-8 is held for a few tokens at most, then goes out as U+FFFD, as a whole decode shows it; a
    character that follows it still comes out whole, and every token goes out."""
    ids = _broken(tokenizer)[case]
    whole = tokenizer.decode(ids)
    assert "\ufffd" in whole
    deltas = _deltas(tokenizer, ids)
    assert "".join(deltas) == whole
    assert max(map(len, deltas)) <= 10, "the text went out as it came, not held to the end"
    assert _stream(tokenizer, ids) == (whole, ids)


# Byte-level tokens that make characters, or broken UTF-8, in any order: the one-byte tokens of a rare CJK character
# (0xF0 0xA3 0xAF 0xA9 ...), the rocket's three (a two-byte head), a CJK character's, ASCII, and a special token.
_BYTE_TOKENS = ["𣯩𪈗", "🚀", "日", "é", " a"]


@settings(max_examples=300, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, len(_BYTE_TOKENS)), st.integers(0, 7)), min_size=1, max_size=40))
def test_any_byte_tokens_join_to_the_whole_decode(tokenizer, picks: list[tuple[int, int]]) -> None:
    """Whatever the tokens, whole characters or stray bytes: the deltas join to what a whole decode gives, so a
    character is never cut where the whole decode has none, and U+FFFD appears where it has one."""
    ids = []
    for pick, index in picks:
        if pick == len(_BYTE_TOKENS):
            ids.append(2)
            continue
        tokens = tokenizer(_BYTE_TOKENS[pick], add_special_tokens=False).input_ids
        ids.append(tokens[index % len(tokens)])
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(_deltas(tokenizer, ids)) == whole
    assert _stream(tokenizer, ids) == (whole, ids)


class _CountingTokenizer:
    """The real tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self._tokenizer = tokenizer
        self.added_tokens_decoder = tokenizer.added_tokens_decoder
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.decoded += len(ids)
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def test_hostile_tokens_cost_what_ascii_costs(tokenizer) -> None:
    """A run of lone bytes (or of special tokens) used to be held whole and re-decoded on every token: 8,000 of them
    took over 100 times as long as 8,000 ASCII tokens, on the gateway's event loop. Now the window stays a few tokens
    long: the work per token is bounded, counted in token ids decoded, and timed side by side."""
    count = 8000
    ascii_ids = tokenizer("a", add_special_tokens=False).input_ids * count
    runs = {"ascii": ascii_ids, "lone bytes": [LONE_BYTE] * count, "special": ascii_ids[:5] + [2] * count}

    def cost(ids: list[int]) -> tuple[int, float]:
        counting = _CountingTokenizer(tokenizer)
        stream = TextStream(counting, [], [])
        start = time.perf_counter()
        text = "".join(stream.add([token], last=i == len(ids) - 1)[0] for i, token in enumerate(ids))
        seconds = time.perf_counter() - start
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        return counting.decoded, seconds

    decoded, seconds = {}, {}
    for _ in range(3):  # side by side, the best of three: the other core may be busy
        for name, ids in runs.items():
            decoded[name], elapsed = cost(ids)
            seconds[name] = min(seconds.get(name, elapsed), elapsed)
    assert decoded["ascii"] <= 4 * count
    assert decoded["lone bytes"] <= 5 * decoded["ascii"] and decoded["special"] <= 5 * decoded["ascii"]
    assert seconds["lone bytes"] < 5 * seconds["ascii"] and seconds["special"] < 5 * seconds["ascii"], seconds
