"""What the prefill worker checks of a PrefillRequest before its engine takes it (engine/validation.py has the
checks both roles share). A ValueError names the fault; the servicer returns it as INVALID_ARGUMENT."""

from __future__ import annotations

from engine.validation import check_decoded, check_prompt
from protos import prefill_pb2
from protos.convert import sampling_from_pb
from protos.types import ModelSpec, SamplingParams, check_cache_salt


def checked_prompt(spec: ModelSpec, request: prefill_pb2.PrefillRequest) -> tuple[list[int], SamplingParams]:
    """The request's prompt token ids and sampling parameters, once they pass every check."""
    token_ids = list(request.token_ids)
    check_prompt(spec, len(token_ids), 1, token_ids)  # the one token prefill generates: the first
    check_decoded(len(token_ids), request.decoded_tokens)
    check_cache_salt(request.cache_salt)
    if not request.decode_address or not request.reservation_token:
        raise ValueError("decode_address and reservation_token are required")
    return token_ids, sampling_from_pb(request.sampling)
