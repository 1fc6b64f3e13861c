"""Incremental detokenization and stop strings, with the real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.detokenizer import IncrementalDetokenizer, StopMatcher


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
