"""What the decode worker checks of a DecodeRequest before it reserves anything (engine/validation.py has the
checks both roles share). A ValueError names the fault; the servicer returns it as INVALID_ARGUMENT."""

from __future__ import annotations

from decode_service.reservations import DecodeParams
from engine.validation import check_decoded, check_prompt
from protos import decode_pb2
from protos.convert import sampling_from_pb
from protos.types import MAX_TPOT_TARGET_MS, ModelSpec, check_cache_salt

MIN_HEARTBEAT_MS = 50  # a colocated prompt's `prefilling` events: no caller may ask for a flood


def decode_params(spec: ModelSpec, request: decode_pb2.DecodeRequest) -> DecodeParams:
    """The request as the reservation keeps it, once it passes every check."""
    if not request.request_id:
        raise ValueError("request_id is required")
    check_prompt(spec, request.prompt_tokens, request.max_tokens, request.prompt_token_ids, "prompt_token_ids")
    if request.decoded_tokens and not request.prompt_token_ids:
        raise ValueError("decoded_tokens is for a colocated request: it needs prompt_token_ids")
    check_decoded(request.prompt_tokens, request.decoded_tokens)
    if request.cache_salt and not request.prompt_token_ids:
        raise ValueError("cache_salt is for a colocated request: it needs prompt_token_ids")
    check_cache_salt(request.cache_salt)
    if request.heartbeat_ms and not request.prompt_token_ids:
        raise ValueError("heartbeat_ms is for a colocated request: it needs prompt_token_ids")
    if 0 < request.heartbeat_ms < MIN_HEARTBEAT_MS:
        raise ValueError(f"heartbeat_ms {request.heartbeat_ms}: must be 0 (none) or >= {MIN_HEARTBEAT_MS}")
    if request.tpot_target_ms > MAX_TPOT_TARGET_MS:
        raise ValueError(f"tpot_target_ms {request.tpot_target_ms}: must be at most {MAX_TPOT_TARGET_MS}")
    if request.split_tokens and not request.prompt_token_ids:
        raise ValueError("split_tokens is for a colocated request: it needs prompt_token_ids")
    if request.split_tokens and not request.split_tokens < request.prompt_tokens:
        raise ValueError(f"split_tokens {request.split_tokens}: must be less than prompt_tokens "
                         f"{request.prompt_tokens} (this worker prefills the rest)")
    if request.split_tokens and request.decoded_tokens:
        raise ValueError("split_tokens and decoded_tokens: a migrated stream's prompt is not split")
    sampling = sampling_from_pb(request.sampling)
    return DecodeParams(request.request_id, request.prompt_tokens, request.max_tokens, sampling,
                        request.ignore_eos, tuple(request.prompt_token_ids), request.decoded_tokens,
                        request.cache_salt, request.heartbeat_ms, request.tpot_target_ms, request.split_tokens)
