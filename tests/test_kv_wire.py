"""The KV wire codec: round trips through chunking, and every malformed stream refused with its status."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_wire.layout import WIRE_DTYPES, KVLayout, KVTransferError, TransferState
from kv_wire.receiver import KVReceiver
from kv_wire.sender import KVSender
from model_runner.loading import ModelSpec
from protos import kv_transfer_pb2 as pb


def _spec(layers: int, heads: int, head_dim: int, dtype: str) -> ModelSpec:
    return ModelSpec(name="t", fingerprint="fp", dtype=dtype, num_layers=layers, num_kv_heads=heads,
                     head_dim=head_dim, vocab_size=100, max_model_len=4096, eos_token_ids=(2,))


def _encode(
    spec: ModelSpec, kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: int, chunk: int
) -> list[pb.KVTransfer]:
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, tokens, spec.dtype)
    sender = KVSender("r1", "token", spec.fingerprint, layout, chunk)
    messages = [sender.header()]
    for i, (k, v) in enumerate(kv):
        messages += sender.layer(i, k, v)
    return messages + [sender.trailer(7)]


def _random_kv(spec: ModelSpec, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (spec.num_kv_heads, tokens, spec.head_dim)
    dtype = WIRE_DTYPES[spec.dtype]
    return [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(spec.num_layers)]


def _decode(spec: ModelSpec, messages: list[pb.KVTransfer], tokens: int, max_chunk: int = 1 << 22):
    receiver = KVReceiver(spec, max_chunk)
    receiver.accept_header(messages[0].header, tokens)
    for message in messages[1:-1]:
        receiver.accept_chunk(message.chunk)
    return receiver, receiver.finish(messages[-1].trailer)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 4), heads=st.integers(1, 4), head_dim=st.sampled_from([1, 8, 64]),
       tokens=st.integers(1, 70), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       chunk=st.integers(1, 5000))
def test_round_trip_is_bit_exact(layers: int, heads: int, head_dim: int, tokens: int, dtype: str, chunk: int) -> None:
    spec = _spec(layers, heads, head_dim, dtype)
    kv = _random_kv(spec, tokens)
    messages = _encode(spec, kv, tokens, chunk)
    assert all(len(m.chunk.data) <= chunk for m in messages[1:-1])
    receiver, received = _decode(spec, messages, tokens)
    assert receiver.state is TransferState.COMPLETE
    assert received.first_token == 7 and received.nbytes == sum(k.nbytes + v.nbytes for k, v in kv)
    for (k, v), (k2, v2) in zip(kv, received.layers):
        assert torch.equal(k.view(torch.uint8), k2.contiguous().view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), v2.contiguous().view(torch.uint8))


SPEC = _spec(2, 2, 8, "float32")
TOKENS = 5


def _good() -> list[pb.KVTransfer]:
    torch.manual_seed(0)
    return _encode(SPEC, _random_kv(SPEC, TOKENS), TOKENS, chunk=64)


def _corrupt(messages: list[pb.KVTransfer]) -> list[pb.KVTransfer]:
    messages[3].chunk.data = bytes([messages[3].chunk.data[0] ^ 1]) + messages[3].chunk.data[1:]
    return messages


def _drop(messages: list[pb.KVTransfer]) -> list[pb.KVTransfer]:
    del messages[4]
    return messages


def _swap(messages: list[pb.KVTransfer]) -> list[pb.KVTransfer]:
    messages[2], messages[3] = messages[3], messages[2]
    return messages


def _duplicate(messages: list[pb.KVTransfer]) -> list[pb.KVTransfer]:
    messages.insert(3, messages[2])
    return messages


def _oversized(messages: list[pb.KVTransfer]) -> list[pb.KVTransfer]:
    last_chunk = messages[-2].chunk
    last_chunk.data += b"\0" * 8
    return messages


def _truncate(messages: list[pb.KVTransfer]) -> list[pb.KVTransfer]:
    return messages[:6] + [messages[-1]]


def _wrong_trailer(messages: list[pb.KVTransfer]) -> list[pb.KVTransfer]:
    messages[-1].trailer.num_chunks += 1
    return messages


@pytest.mark.parametrize(("damage", "code"), [
    (_corrupt, grpc.StatusCode.DATA_LOSS),
    (_drop, grpc.StatusCode.INVALID_ARGUMENT),
    (_swap, grpc.StatusCode.INVALID_ARGUMENT),
    (_duplicate, grpc.StatusCode.INVALID_ARGUMENT),
    (_oversized, grpc.StatusCode.DATA_LOSS),
    (_truncate, grpc.StatusCode.DATA_LOSS),
    (_wrong_trailer, grpc.StatusCode.DATA_LOSS),
])
def test_damaged_stream_is_refused_with_its_status_and_buffer_dropped(damage, code: grpc.StatusCode) -> None:
    messages = damage(_good())
    receiver = KVReceiver(SPEC, 1 << 20)
    with pytest.raises(KVTransferError) as refused:
        receiver.accept_header(messages[0].header, TOKENS)
        for message in messages[1:-1]:
            receiver.accept_chunk(message.chunk)
        receiver.finish(messages[-1].trailer)
    assert refused.value.code == code
    assert receiver.state is TransferState.FAILED and receiver.held_bytes == 0


@pytest.mark.parametrize(("field", "value", "code"), [
    ("model_fingerprint", "other-model", grpc.StatusCode.FAILED_PRECONDITION),
    ("dtype", "int8", grpc.StatusCode.FAILED_PRECONDITION),
    ("num_layers", 3, grpc.StatusCode.INVALID_ARGUMENT),
    ("num_tokens", TOKENS + 1, grpc.StatusCode.INVALID_ARGUMENT),
    ("chunk_bytes", 0, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_mismatched_header_is_refused(field: str, value: object, code: grpc.StatusCode) -> None:
    header = _good()[0].header
    setattr(header, field, value)
    with pytest.raises(KVTransferError) as refused:
        KVReceiver(SPEC, 1 << 20).accept_header(header, TOKENS)
    assert refused.value.code == code


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_float32_kv_downcast_on_the_wire_is_marked_and_accepted(wire: str) -> None:
    torch.manual_seed(0)
    kv = _random_kv(SPEC, TOKENS)
    layout = KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, TOKENS, wire)
    sender = KVSender("r1", "token", SPEC.fingerprint, layout, 64)
    messages = [sender.header()]
    for i, (k, v) in enumerate(kv):
        messages += sender.layer(i, k, v)
    messages.append(sender.trailer(7))
    assert messages[0].header.dtype == wire
    assert sender.bytes_sent == sum(k.nbytes + v.nbytes for k, v in kv) // 2
    _, received = _decode(SPEC, messages, TOKENS)
    for (k, _), (k2, _) in zip(kv, received.layers):
        assert torch.equal(k.to(WIRE_DTYPES[wire]), k2)  # exactly the rounded values; decode casts back on admission


def test_bfloat16_model_refuses_float16_wire() -> None:
    header = _encode(_spec(2, 2, 8, "bfloat16"), _random_kv(_spec(2, 2, 8, "bfloat16"), TOKENS), TOKENS, 64)[0].header
    header.dtype = "float16"
    with pytest.raises(KVTransferError) as refused:
        KVReceiver(_spec(2, 2, 8, "bfloat16"), 1 << 20).accept_header(header, TOKENS)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
