"""What a worker checks of a request before its engine takes it, in the same words for both roles.

The gateway checks requests at the front door; a worker checks again, because it trusts no caller with its
model's limits. The servicers turn a ValueError from here into INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence

from protos.types import ModelSpec


def check_prompt(spec: ModelSpec, prompt_tokens: int, max_tokens: int, token_ids: Sequence[int] = (),
                 ids_field: str = "token_ids") -> None:
    """A prompt of `prompt_tokens` tokens (their ids, where the request carries them, in the field `ids_field`)
    that is to generate `max_tokens` more (prefill: its one first token). Raises ValueError naming the fault."""
    limit = spec.max_model_len
    if prompt_tokens < 1:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if prompt_tokens + max_tokens > limit:
        raise ValueError(f"{prompt_tokens} prompt tokens + {max_tokens} to generate exceed the {limit}-token context")
    if token_ids and len(token_ids) != prompt_tokens:
        raise ValueError(f"{ids_field} holds {len(token_ids)} tokens, prompt_tokens says {prompt_tokens}")
    if token_ids and max(token_ids) >= spec.vocab_size:
        raise ValueError(f"{ids_field}: {max(token_ids)} is outside the vocabulary (size {spec.vocab_size})")
