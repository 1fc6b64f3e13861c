"""Decode reservations: the slot and KV byte budget are never exceeded, whatever the order of requests."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_service.reservations import CapacityExhausted, DecodeParams, ReservationTable
from kv_wire.layout import KVTransferError
from protos.types import SamplingParams

BYTES_PER_TOKEN = 100


def _params(request_id: str, prompt: int, max_tokens: int) -> DecodeParams:
    return DecodeParams(request_id, prompt, max_tokens, SamplingParams(), ignore_eos=False)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(1, 400), st.integers(1, 400)), max_size=60))
def test_budget_is_never_exceeded_and_frees_exactly(steps: list[tuple[bool, int, int]]) -> None:
    table = ReservationTable(max_seqs=4, kv_budget_bytes=50_000, kv_bytes_per_token=BYTES_PER_TOKEN, lease_s=30)
    live = []
    for n, (reserve, prompt, max_tokens) in enumerate(steps):
        if reserve or not live:
            needed = (prompt + max_tokens) * BYTES_PER_TOKEN
            fits = len(live) < 4 and table.kv_bytes + needed <= 50_000
            try:
                live.append(table.reserve(_params(f"r{n}", prompt, max_tokens)))
                assert fits
            except CapacityExhausted:
                assert not fits  # refused only when it would not fit
        else:
            table.release(live.pop(0))
        assert table.kv_bytes <= 50_000 and len(live) <= 4
        assert table.kv_bytes == sum(r.kv_bytes for r in live)
    for reservation in live:
        table.release(reservation)
    assert table.kv_bytes == 0 and table.awaiting_kv == 0


def test_each_attempt_is_its_own_reservation_and_only_its_token_claims_it() -> None:
    table = ReservationTable(max_seqs=4, kv_budget_bytes=10**9, kv_bytes_per_token=BYTES_PER_TOKEN, lease_s=30)
    earlier = table.reserve(_params("same-id", 5, 5))
    retry = table.reserve(_params("same-id", 5, 5))  # a retry before the earlier attempt was released
    assert earlier.token != retry.token
    assert table.claim("same-id", retry.token) is retry
    with pytest.raises(KVTransferError) as reused:
        table.claim("same-id", retry.token)
    assert reused.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(KVTransferError) as wrong_request:
        table.claim("another-id", earlier.token)
    assert wrong_request.value.code == grpc.StatusCode.PERMISSION_DENIED
    table.release(earlier)
    with pytest.raises(KVTransferError):
        table.claim("same-id", earlier.token)  # released: gone
