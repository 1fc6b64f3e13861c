"""Worker-side request checks (engine/validation.py): one rule, one wording, for prefill and decode alike."""

from __future__ import annotations

import re

import pytest

from engine.validation import check_decoded, check_prompt
from protos.types import ModelSpec

SPEC = ModelSpec(name="t", fingerprint="fp", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=8,
                 vocab_size=100, max_model_len=16, eos_token_ids=(2,))


@pytest.mark.parametrize(("prompt_tokens", "max_tokens", "token_ids", "fault"), [
    (0, 1, (), "the prompt is empty"),
    (4, 0, (), "max_tokens must be >= 1"),
    (16, 1, (), "16 prompt tokens + 1 to generate exceed the 16-token context"),  # prefill: no room for a token
    (10, 7, (), "10 prompt tokens + 7 to generate exceed the 16-token context"),
    (3, 1, (1, 2), "token_ids holds 2 tokens, prompt_tokens says 3"),
    (2, 1, (1, 100), "token_ids: 100 is outside the vocabulary (size 100)"),
])
def test_a_prompt_the_model_cannot_take_is_refused_naming_its_fault(
    prompt_tokens: int, max_tokens: int, token_ids: tuple[int, ...], fault: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(fault)}$"):
        check_prompt(SPEC, prompt_tokens, max_tokens, token_ids)


def test_a_prompt_that_fits_passes() -> None:
    check_prompt(SPEC, 15, 1, list(range(15)))  # prefill: a full context less the first token
    check_prompt(SPEC, 4, 12)  # decode, KV from prefill: no ids
    check_prompt(SPEC, 3, 1, (0, 1, 99), "prompt_token_ids")


def test_a_prompt_must_keep_at_least_one_token_that_was_not_decoded() -> None:
    check_decoded(5, 0)
    check_decoded(5, 4)
    with pytest.raises(ValueError, match=r"^decoded_tokens \(5\) must be fewer than the prompt's 5 tokens"):
        check_decoded(5, 5)
