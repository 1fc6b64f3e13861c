"""The KV wire codec: round trips through chunking on both paths, and every malformed stream refused."""

from __future__ import annotations

import asyncio
import os
import pwd
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_wire import codec, segments
from kv_wire import sender as sender_module
from kv_wire.layout import (
    COPY_BLOCK_BYTES,
    WIRE_DTYPES,
    KVLayout,
    KVTransferError,
    TransferState,
    checksum,
    copy_with_checksum,
)
from kv_wire.receiver import KVReceiver, ReceivedKV
from kv_wire.segments import Segment, SegmentMaps, SegmentPool
from kv_wire.sender import KVSender, encode_stream, host_bytes
from model_runner.paged_cache import BLOCK_SIZE, PagedKVCache
from protos import kv_transfer_pb2 as pb
from protos.types import ModelSpec

SEGMENTS = SegmentPool(keep_bytes=64 << 20)
TRANSPORTS = ["grpc", "shm"]


def _spec(layers: int, heads: int, head_dim: int, dtype: str) -> ModelSpec:
    return ModelSpec(name="t", fingerprint="fp", dtype=dtype, num_layers=layers, num_kv_heads=heads,
                     head_dim=head_dim, vocab_size=100, max_model_len=4096, eos_token_ids=(2,))


@contextmanager
def _segment(transport: str, nbytes: int) -> Iterator[Segment | None]:
    """For "shm", a real /dev/shm segment lent to the reservation token "token", taken back afterwards."""
    if transport == "grpc":
        yield None
        return
    segment = SEGMENTS.acquire(nbytes)
    segments.stamp(segment, "token")
    try:
        yield segment
    finally:
        segments.stamp(segment, None)
        SEGMENTS.release(segment)


def _wire(
    spec: ModelSpec, kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: int, chunk: int,
    segment: Segment | None = None, wire_dtype: str = "",
) -> tuple[pb.KVTransfer, list[bytes], pb.KVTransfer]:
    """Header, the messages the sender sends when every layer is waiting, trailer."""
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, tokens, wire_dtype or spec.dtype)
    lent = SegmentMaps().open(segment.name, "token", layout.total_bytes) if segment and segment.name else None
    assert (segment is None) == (lent is None), "the segment must open as the one lent to 'token'"
    sender = KVSender("r1", "token", spec.fingerprint, layout, chunk, segment=lent)
    header = sender.header()
    messages = list(sender.encode([(i, k, v) for i, (k, v) in enumerate(kv)]))
    return header, messages, sender.trailer(7)


def _encode(
    spec: ModelSpec, kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: int, chunk: int,
    segment: Segment | None = None, wire_dtype: str = "",
) -> list[pb.KVTransfer]:
    """Header, one chunk a message (the receiver takes a KVChunks' chunks as if they came alone), trailer."""
    header, wire, trailer = _wire(spec, kv, tokens, chunk, segment, wire_dtype)
    return [header, *_one_chunk_a_message(wire), trailer]


def _one_chunk_a_message(wire: list[bytes]) -> list[pb.KVTransfer]:
    chunks = []
    for message in map(pb.KVTransfer.FromString, wire):  # plain protobuf can read the codec's messages
        chunks += [message] if message.HasField("chunk") else [pb.KVTransfer(chunk=c) for c in message.chunks.chunk]
    return chunks


def _random_kv(spec: ModelSpec, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (spec.num_kv_heads, tokens, spec.head_dim)
    dtype = WIRE_DTYPES[spec.dtype]
    return [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(spec.num_layers)]


def _receive(receiver: KVReceiver, messages: list[codec.Received], tokens: int,
             segment: Segment | None) -> ReceivedKV | None:
    """As decode's KV inbox does, less the reservation: the header, then each message through the receiver."""
    receiver.accept_header(receiver.header_of(messages[0]), tokens, segment)
    received = None
    for message in messages[1:]:
        received = receiver.accept(message)
    return received


def _decode(spec: ModelSpec, messages: list[pb.KVTransfer], tokens: int, segment: Segment | None = None,
            max_chunk: int = 1 << 22) -> tuple[KVReceiver, ReceivedKV]:
    """Receive as decode does: each message serialised, then decoded by the wire codec (chunks as views)."""
    wire = [codec.decode(message.SerializeToString()) for message in messages]
    assert all(isinstance(chunk, codec.Chunk) for chunk in wire[1:-1])
    receiver = KVReceiver(spec, max_chunk)
    received = _receive(receiver, wire, tokens, segment)
    assert received is not None
    return receiver, received


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 4), heads=st.integers(1, 4), head_dim=st.sampled_from([1, 8, 64]),
       tokens=st.integers(1, 70), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       chunk=st.integers(1, 5000), transport=st.sampled_from(TRANSPORTS))
def test_round_trip_is_bit_exact(
    layers: int, heads: int, head_dim: int, tokens: int, dtype: str, chunk: int, transport: str
) -> None:
    spec = _spec(layers, heads, head_dim, dtype)
    kv = _random_kv(spec, tokens)
    nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
    with _segment(transport, nbytes) as segment:
        header, wire, trailer = _wire(spec, kv, tokens, chunk, segment)
        assert header.header.shm == (transport == "shm")
        decoded = [codec.decode(message) for message in wire]  # as decode receives them: chunks as views
        messages = [[m] if isinstance(m, codec.Chunk) else m for m in decoded]
        assert all(isinstance(c, codec.Chunk) for m in messages for c in m)
        chunks = [c for m in messages for c in m]
        sizes = [c.length if transport == "shm" else len(c.data) for c in chunks]
        assert sum(sizes) == nbytes
        if transport == "grpc":  # every message full but the last, chunks of whole elements across tensors
            itemsize = WIRE_DTYPES[dtype].itemsize
            full = max(chunk - chunk % itemsize, itemsize)
            carried = [sum(len(c.data) for c in m) for m in messages]
            assert carried[:-1] == [full] * (len(carried) - 1) and 0 < carried[-1] <= full
            assert all(size % itemsize == 0 for size in sizes)
        else:  # only descriptors on the wire, one per tensor
            assert all(not c.data for c in chunks) and len(chunks) == 2 * layers
        receiver = KVReceiver(spec, 1 << 22)
        received = _receive(receiver, [header, *decoded, trailer], tokens, segment)
        assert received is not None
        # Nothing copied on this side: the pieces are views of the received messages, or the segment.
        assert received.in_segment == (transport == "shm")
        if transport == "grpc":
            assert sum(map(len, received.pieces)) == len(chunks)
        else:
            assert received.pieces[0][0][1].data_ptr() == segments.data_region(segment, nbytes).ctypes.data
        assert receiver.state is TransferState.COMPLETE
        assert received.first_token == 7 and received.nbytes == nbytes
        for (k, v), (k2, v2) in zip(kv, received.layers()):
            assert torch.equal(k.view(torch.uint8), k2.contiguous().view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), v2.contiguous().view(torch.uint8))
        # The engine's join (the segment still lent) copies the pieces, wherever chunks cut the heads, into a slot.
        cache = PagedKVCache(layers, 2 * -(-tokens // BLOCK_SIZE) + 1, heads, head_dim, WIRE_DTYPES[dtype],
                             torch.device("cpu"))
        other = cache.allocate(tokens)
        blocks = cache.allocate(tokens)
        cache.load(blocks, received.pieces, tokens)
        for (k2, v2), (k, v) in zip(cache.read(blocks, tokens), kv):
            assert torch.equal(k2, k) and torch.equal(v2, v)
        elsewhere = [block for block in range(cache.num_blocks) if block not in blocks]
        assert other and not cache.kv[:, :, elsewhere].any()  # nothing written outside its blocks


def test_host_bytes_is_a_view_where_it_can_be_and_a_copy_otherwise() -> None:
    kv = torch.randn(2, 5, 4)
    assert host_bytes(kv, torch.float32).ctypes.data == kv.data_ptr()  # the tensor's own memory: no copy
    strided = kv.transpose(0, 1)  # what a cache's (tokens, heads) view would give
    assert np.array_equal(host_bytes(strided, torch.float32), strided.contiguous().view(-1).view(torch.uint8).numpy())
    assert np.array_equal(host_bytes(kv, torch.float16), kv.to(torch.float16).view(-1).view(torch.uint8).numpy())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on the reference machine)")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kv_on_a_gpu_leaves_through_pinned_memory_and_lands_on_a_gpu(transport: str) -> None:
    """Device -> pinned host -> wire -> host -> device, bit-exact; a downcast happens on the device."""
    spec, tokens = _spec(3, 2, 64, "float32"), 37
    kv = _random_kv(spec, tokens)
    on_gpu = [(k.cuda(), v.cuda()) for k, v in kv]
    out = host_bytes(on_gpu[0][0], torch.float32)
    assert torch.from_numpy(out).is_pinned() and np.array_equal(out, kv[0][0].view(-1).view(torch.uint8).numpy())
    half = host_bytes(on_gpu[0][0], torch.bfloat16)
    assert np.array_equal(half, kv[0][0].to(torch.bfloat16).view(-1).view(torch.uint8).numpy())
    nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
    with _segment(transport, nbytes) as segment:
        _, received = _decode(spec, _encode(spec, on_gpu, tokens, 1000, segment), tokens, segment)
        cache = PagedKVCache(spec.num_layers, -(-tokens // BLOCK_SIZE), spec.num_kv_heads, spec.head_dim,
                             torch.float32, torch.device("cuda"))
        blocks = cache.allocate(tokens)
        cache.load(blocks, received.pieces, tokens)
    for (k2, v2), (k, v) in zip(cache.read(blocks, tokens), kv):
        assert torch.equal(k2.cpu(), k) and torch.equal(v2.cpu(), v)


@settings(max_examples=25, deadline=None)
@given(size=st.one_of(st.integers(0, 64), st.integers(COPY_BLOCK_BYTES - 3, 3 * COPY_BLOCK_BYTES + 5)),
       seed=st.integers(0, 2**32 - 1))
def test_blockwise_copy_hashes_exactly_what_it_copied(size: int, seed: int) -> None:
    """The shm sender's copy (hashed block by block, across block boundaries) gives the whole buffer's checksum."""
    source = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    target = np.zeros(size + 1, dtype=np.uint8)  # one byte more: nothing may be written past the copy
    assert copy_with_checksum(target[:size], source) == checksum(source)
    assert np.array_equal(target[:size], source) and target[size] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("arrival", ["all_waiting", "one_by_one"])
def test_stream_packs_the_layers_already_waiting(arrival: str, transport: str, monkeypatch) -> None:
    """encode_stream packs the layers already queued: gRPC messages full across tensor and layer boundaries, shm
    descriptors up to SHM_BATCH_BYTES of KV a message. A layer that arrives alone goes alone, never waiting for the
    next. Either way the stream decodes to the same KV."""
    spec, tokens = _spec(4, 2, 8, "float32"), 5
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, tokens, spec.dtype)
    monkeypatch.setattr(sender_module, "SHM_BATCH_BYTES", 3 * layout.tensor_bytes)  # 3 descriptors a message
    chunk = 3 * layout.tensor_bytes // 4  # a gRPC message holds 3/4 of a tensor: boundaries fall mid-message
    kv = _random_kv(spec, tokens)

    async def stream(lent) -> list[bytes | pb.KVTransfer]:
        items: asyncio.Queue = asyncio.Queue()
        messages = encode_stream(KVSender("r1", "token", spec.fingerprint, layout, chunk, segment=lent), items)
        out = [await anext(messages)]  # the header
        for index, (keys, values) in enumerate(kv):
            items.put_nowait((index, keys, values))
            if arrival == "one_by_one":  # this layer's messages, sent before the next layer exists
                out += [await anext(messages) for _ in range(3 if transport == "grpc" else 1)]
        items.put_nowait(7)
        return out + [message async for message in messages]

    with _segment(transport, layout.total_bytes) as segment:
        lent = SegmentMaps().open(segment.name, "token", layout.total_bytes) if segment and segment.name else None
        wire = [m if isinstance(m, pb.KVTransfer) else pb.KVTransfer.FromString(m) for m in asyncio.run(stream(lent))]
        chunks = [[m.chunk] if m.HasField("chunk") else list(m.chunks.chunk) for m in wire[1:-1]]
        if transport == "shm":
            expected = [3, 3, 2] if arrival == "all_waiting" else [2, 2, 2, 2]  # descriptors a message
            assert [len(m) for m in chunks] == expected
        else:  # KV bytes a message, in quarters of a tensor: a layer is 8 quarters
            quarters = [sum(len(c.data) for c in m) * 4 // layout.tensor_bytes for m in chunks]
            assert quarters == ([3] * 10 + [2] if arrival == "all_waiting" else [3, 3, 2] * 4)
        received = _receive(KVReceiver(spec, 1 << 20), list(wire), tokens, segment)
        assert received is not None
        for (k, v), (k2, v2) in zip(kv, received.layers()):
            assert torch.equal(k, k2) and torch.equal(v, v2)


SPEC = _spec(2, 2, 8, "float32")
TOKENS = 5
_TENSOR = KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, TOKENS, SPEC.dtype).tensor_bytes


def _good(segment: Segment | None = None) -> list[pb.KVTransfer]:
    torch.manual_seed(0)
    return _encode(SPEC, _random_kv(SPEC, TOKENS), TOKENS, chunk=64, segment=segment)


# Each damage takes the messages and the lent segment (None on the gRPC path) and returns the damaged stream.
# Messages: header, chunks (4 on the shm path: one per tensor; 20 on the gRPC path), trailer.
def _corrupt(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    chunk = messages[3].chunk
    if segment is None:
        chunk.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
    else:  # a byte of the chunk flipped in shared memory after the checksum was taken
        place = segments.STAMP_BYTES + (chunk.layer * 2 + chunk.kind - 1) * _TENSOR + chunk.offset
        segment.array[place] ^= 1
    return messages


def _drop(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    del messages[2]
    return messages


def _swap(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    messages[2], messages[3] = messages[3], messages[2]
    return messages


def _duplicate(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    messages.insert(3, messages[2])
    return messages


def _oversized(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    last_chunk = messages[-2].chunk
    if segment is None:
        last_chunk.data += b"\0" * 8
    else:
        last_chunk.length += 8
    return messages


def _truncate(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    return messages[:3] + [messages[-1]]


def _wrong_trailer(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    messages[-1].trailer.num_chunks += 1
    return messages


def _split_element(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    """A chunk that ends inside a float32 element."""
    if segment is None:
        messages[1].chunk.data = messages[1].chunk.data[:-1]
    else:
        messages[1].chunk.length -= 1
    return messages


def _mixed(messages: list[pb.KVTransfer], segment: Segment | None) -> list[pb.KVTransfer]:
    """A chunk of the other path's kind: data in an shm stream, a length in a gRPC one."""
    if segment is None:
        messages[2].chunk.length = len(messages[2].chunk.data)
    else:
        messages[2].chunk.data = b"\0" * messages[2].chunk.length
    return messages


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("damage", "code"), [
    (_corrupt, grpc.StatusCode.DATA_LOSS),
    (_drop, grpc.StatusCode.INVALID_ARGUMENT),
    (_swap, grpc.StatusCode.INVALID_ARGUMENT),
    (_duplicate, grpc.StatusCode.INVALID_ARGUMENT),
    (_oversized, grpc.StatusCode.DATA_LOSS),
    (_truncate, grpc.StatusCode.DATA_LOSS),
    (_wrong_trailer, grpc.StatusCode.DATA_LOSS),
    (_mixed, grpc.StatusCode.INVALID_ARGUMENT),
    (_split_element, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_damaged_stream_is_refused_with_its_status(damage, code: grpc.StatusCode, transport: str) -> None:
    receiver = KVReceiver(SPEC, 1 << 20)
    with _segment(transport, 2 * SPEC.num_layers * _TENSOR) as segment:
        messages = damage(_good(segment), segment)
        with pytest.raises(KVTransferError) as refused:
            _receive(receiver, [codec.decode(message.SerializeToString()) for message in messages], TOKENS, segment)
    assert refused.value.code == code
    assert receiver.state is TransferState.FAILED


def test_empty_chunks_message_is_refused() -> None:
    receiver = KVReceiver(SPEC, 1 << 20)
    receiver.accept_header(_good()[0].header, TOKENS, None)
    with pytest.raises(KVTransferError) as refused:
        receiver.accept_chunks([])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and receiver.state is TransferState.FAILED


def test_shm_header_without_a_lent_segment_is_refused() -> None:
    with _segment("shm", 2 * SPEC.num_layers * _TENSOR) as segment:
        header = _good(segment)[0].header
    with pytest.raises(KVTransferError) as refused:
        KVReceiver(SPEC, 1 << 20).accept_header(header, TOKENS, None)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_sender_stops_writing_once_decode_takes_the_segment_back() -> None:
    layout = KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, TOKENS, SPEC.dtype)
    kv = _random_kv(SPEC, TOKENS)
    with _segment("shm", layout.total_bytes) as segment:
        assert segment is not None and segment.name is not None
        lent = SegmentMaps().open(segment.name, "token", layout.total_bytes)
        assert lent is not None and SegmentMaps().open(segment.name, "other-token", layout.total_bytes) is None
        sender = KVSender("r1", "token", SPEC.fingerprint, layout, 64, segment=lent)
        list(sender.encode([(0, *kv[0])]))
        segments.stamp(segment, None)  # decode released the reservation
        before = segment.array.copy()
        with pytest.raises(KVTransferError) as stopped:
            list(sender.encode([(1, *kv[1])]))
        assert stopped.value.code == grpc.StatusCode.CANCELLED
        assert np.array_equal(before, segment.array)  # layer 1 never written


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_computed_in_the_segment_is_hashed_where_it_lies_never_copied(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(3, 2, 8, dtype)
    tokens = 11
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, tokens, dtype)
    kv = _random_kv(spec, tokens)

    def no_copy(target: np.ndarray, source: np.ndarray) -> int:
        raise AssertionError("KV already in its place was copied")

    with _segment("shm", layout.total_bytes) as segment:
        assert segment is not None
        lent = SegmentMaps().open(segment.name, "token", layout.total_bytes)
        assert lent is not None
        homes = lent.tensors(layout)
        for (keys, values), (home_keys, home_values) in zip(kv, homes):  # as the forward pass writes them
            assert home_keys.shape == home_values.shape == layout.tensor_shape
            home_keys.copy_(keys)
            home_values.copy_(values)
        monkeypatch.setattr(sender_module, "copy_with_checksum", no_copy)
        sender = KVSender("r1", "token", spec.fingerprint, layout, 64, segment=lent)
        header = sender.header()
        chunks = _one_chunk_a_message(list(sender.encode([(i, *home) for i, home in enumerate(homes)])))
        assert len(chunks) == 2 * spec.num_layers and sender.bytes_sent == layout.total_bytes
        _, received = _decode(spec, [header, *chunks, sender.trailer(7)], tokens, segment)
        for (keys, values), (got_keys, got_values) in zip(kv, received.layers()):  # read where decode reads them
            assert torch.equal(keys.view(torch.uint8), got_keys.contiguous().view(torch.uint8))
            assert torch.equal(values.view(torch.uint8), got_values.contiguous().view(torch.uint8))


def test_segments_of_dead_owners_are_removed_and_live_ones_kept() -> None:
    live = SEGMENTS.acquire(1)
    dead_pid = 2**22 + 12345  # above pid_max on Linux defaults: never a live process
    orphan = segments.SHM_DIR / f"{segments.SEGMENT_PREFIX}{dead_pid}-{'ab' * 8}"
    orphan.write_bytes(b"left by a killed worker")
    try:
        assert segments.remove_orphans() >= 1
        assert not orphan.exists()
        assert (segments.SHM_DIR / str(live.name)).exists()
    finally:
        orphan.unlink(missing_ok=True)
        SEGMENTS.release(live)


def test_pool_reuses_warm_segments_and_bounds_what_it_keeps() -> None:
    pool = SegmentPool(keep_bytes=4 << 20)
    first = pool.acquire(3 << 20)
    assert first.size == 4 << 20 and pool.held_bytes == 4 << 20
    pool.release(first)
    second = pool.acquire(1 << 20)  # the idle 4 MiB segment fits: reused, not a new segment
    assert second is first and pool.idle_bytes == 0
    big = pool.acquire(5 << 20)
    pool.release(second)
    pool.release(big)  # 4 + 8 MiB idle > 4 MiB kept: the largest is unmapped and its name removed
    assert pool.idle_bytes == 4 << 20 and not (segments.SHM_DIR / str(big.name)).exists()
    pool.close()
    assert not (segments.SHM_DIR / str(first.name)).exists()


def test_the_pool_makes_segments_on_a_thread_that_yields_the_core_to_the_engine() -> None:
    pool = SegmentPool(keep_bytes=4 << 20)
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    maker = pool.maker.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(10)
    assert maker == min(here + segments.MAKER_NICENESS, 19)  # this thread, and so the engine, keep their own
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here
    made = pool.maker.submit(pool.acquire, 1 << 20).result(10)
    assert made.size >= 1 << 20
    pool.release(made)
    pool.close()


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
        KVReceiver(SPEC, 1 << 20).accept_header(header, TOKENS, None)
    assert refused.value.code == code


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_float32_kv_downcast_on_the_wire_is_marked_and_accepted(wire: str, transport: str) -> None:
    torch.manual_seed(0)
    kv = _random_kv(SPEC, TOKENS)
    with _segment(transport, 2 * SPEC.num_layers * _TENSOR) as segment:
        messages = _encode(SPEC, kv, TOKENS, 64, segment, wire_dtype=wire)
        assert messages[0].header.dtype == wire
        assert messages[-1].trailer.total_bytes == sum(k.nbytes + v.nbytes for k, v in kv) // 2
        _, received = _decode(SPEC, messages, TOKENS, segment)
        for (k, _), (k2, _) in zip(kv, received.layers()):
            assert torch.equal(k.to(WIRE_DTYPES[wire]), k2)  # exactly the rounded values; decode casts back on join


def test_bfloat16_model_refuses_float16_wire() -> None:
    header = _encode(_spec(2, 2, 8, "bfloat16"), _random_kv(_spec(2, 2, 8, "bfloat16"), TOKENS), TOKENS, 64)[0].header
    header.dtype = "float16"
    with pytest.raises(KVTransferError) as refused:
        KVReceiver(_spec(2, 2, 8, "bfloat16"), 1 << 20).accept_header(header, TOKENS, None)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_codec_reads_protobuf_chunks_and_protobuf_reads_codec_chunks() -> None:
    data = np.frombuffer(bytes(range(256)) * 5, dtype=np.uint8)
    one = codec.encode_pieces([codec.Piece(3, pb.KV_KIND_VALUES, 4096, data)])
    expected = pb.KVChunk(layer=3, kind=pb.KV_KIND_VALUES, offset=4096, data=data.tobytes(), checksum=checksum(data))
    assert pb.KVTransfer.FromString(one).chunk == expected
    assert one == pb.KVTransfer(chunk=expected).SerializeToString()  # byte for byte what protobuf writes
    several = codec.encode_pieces([codec.Piece(3, pb.KV_KIND_VALUES, 4096, data[:8]),
                                   codec.Piece(0, pb.KV_KIND_KEYS, 0, data[8:])])  # zeros, which protobuf leaves out
    expected_chunks = [
        pb.KVChunk(layer=3, kind=pb.KV_KIND_VALUES, offset=4096, data=data[:8].tobytes(), checksum=checksum(data[:8])),
        pb.KVChunk(layer=0, kind=pb.KV_KIND_KEYS, offset=0, data=data[8:].tobytes(), checksum=checksum(data[8:]))]
    assert list(pb.KVTransfer.FromString(several).chunks.chunk) == expected_chunks
    assert several == pb.KVTransfer(chunks=pb.KVChunks(chunk=expected_chunks)).SerializeToString()
    decoded = codec.decode(several)
    assert isinstance(decoded, list) and [(c.layer, c.offset, bytes(c.data), c.checksum) for c in decoded] == [
        (3, 4096, data[:8].tobytes(), checksum(data[:8])), (0, 0, data[8:].tobytes(), checksum(data[8:]))]
    # protobuf's own encoding, with a field this version does not know (a newer sender), decodes on the fast path
    generic = pb.KVTransfer(chunk=pb.KVChunk(layer=1, kind=pb.KV_KIND_KEYS, offset=8, length=64, checksum=9))
    raw = generic.SerializeToString()
    unknown = b"\x12" + bytes([raw[1] + 3]) + raw[2:] + b"\x78\x96\x01"  # field 15 varint 150 inside the chunk
    chunk = codec.decode(unknown)
    assert isinstance(chunk, codec.Chunk)
    assert (chunk.layer, chunk.kind, chunk.offset, chunk.length, chunk.checksum, bytes(chunk.data)) == (
        1, pb.KV_KIND_KEYS, 8, 64, 9, b"")


@pytest.mark.parametrize("raw", [
    b"\x12\x05\x08",  # chunk shorter than its length
    b"\x12\x03\x22\x7f\x00",  # data field runs past the message
    b"\x12\x02\x0b\x00",  # wire type 3 (groups) in a chunk
    b"\x12\x05\x29\x01\x02\x03\x04",  # fixed64 checksum cut short
    b"\x22\x04\x0a\x02\x0b\x00",  # a chunks message whose chunk is malformed
    b"\xff\xff\xff",  # not protobuf at all
])
def test_codec_turns_garbage_into_malformed_never_an_exception(raw: bytes) -> None:
    assert isinstance(codec.decode(raw), codec.Malformed)


def test_prefill_lets_go_of_segments_decode_retired() -> None:
    # 1. Prefill maps two lent segments; decode then retires one (a cancelled request) and keeps the other.
    pool = SegmentPool(keep_bytes=64 << 20)
    retired, kept = pool.acquire(1 << 20), pool.acquire(1 << 20)
    segments.stamp(retired, "t1")
    segments.stamp(kept, "t2")
    maps = SegmentMaps()
    try:
        assert maps.open(retired.name, "t1", 1024) is not None and maps.open(kept.name, "t2", 1024) is not None
        assert maps.mapped_bytes == retired.size + kept.size
        pool.discard(retired)
        # 2. At the request's end prefill prunes: the retired segment's pages are no longer held here.
        maps.prune()
        assert maps.mapped_bytes == kept.size
        assert maps.open(kept.name, "t2", 1024) is not None  # the live one is still reused
    finally:
        maps.close()
        pool.release(kept)
        pool.close()


def test_an_owner_is_known_dead_by_its_free_lock_even_where_its_pid_lives() -> None:
    """A decode container SIGKILLed beside another that shares its /dev/shm volume: its pid (each container
    counts from 1) may well be alive here. Its lock file is what tells: nobody holds it any more."""
    live = SEGMENTS.acquire(1)  # this process's own segment: its owner lock is held
    pid, tag = os.getpid(), "0badc0de"  # a live pid, a dead owner
    lock = segments.SHM_DIR / f"{segments.SEGMENT_PREFIX}{pid}-{tag}.lock"
    orphan = segments.SHM_DIR / f"{segments.SEGMENT_PREFIX}{pid}-{tag}{'12' * 4}"
    lock.write_bytes(b"")
    orphan.write_bytes(b"left by a killed container")
    try:
        assert segments.remove_orphans() >= 1
        assert not orphan.exists() and not lock.exists()
        assert (segments.SHM_DIR / str(live.name)).exists()  # its owner's lock is held: kept
        own_lock = segments.SHM_DIR / f"{segments.SEGMENT_PREFIX}{pid}-{str(live.name)[-16:-8]}.lock"
        assert own_lock.exists()
    finally:
        orphan.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
        SEGMENTS.release(live)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a segment owned by another user")
def test_another_users_segment_in_dev_shm_is_left_alone_by_the_startup_sweep() -> None:
    # 1. /dev/shm holds two segments of a dead pid: one another user's (nobody's), one this user's.
    nobody = pwd.getpwnam("nobody")
    dead_pid = 2**22 + 4321  # above pid_max on Linux defaults: never a live process
    theirs = segments.SHM_DIR / f"{segments.SEGMENT_PREFIX}{dead_pid}-{'cd' * 8}"
    ours = segments.SHM_DIR / f"{segments.SEGMENT_PREFIX}{dead_pid}-{'ef' * 8}"
    theirs.write_bytes(b"another user's")
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    ours.write_bytes(b"ours")
    try:
        # 2. The sweep a decode worker runs at startup removes its own user's orphan only. (Another user's
        # segment used to be unlinked, or, for a user other than the owner of /dev/shm, to fail the worker's
        # start with a PermissionError from the sticky directory.)
        assert segments.remove_orphans() >= 1
        assert theirs.exists() and not ours.exists()
    finally:
        theirs.unlink(missing_ok=True)
        ours.unlink(missing_ok=True)


def test_a_stream_must_open_with_its_header_and_carry_no_other() -> None:
    messages = _good()
    opened_with_a_chunk = KVReceiver(SPEC, 1 << 20)
    with pytest.raises(KVTransferError) as refused:
        opened_with_a_chunk.header_of(messages[1])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and opened_with_a_chunk.state is TransferState.FAILED
    with pytest.raises(KVTransferError) as refused:
        KVReceiver(SPEC, 1 << 20).header_of(None)  # the stream ended before its first message
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    second_header = KVReceiver(SPEC, 1 << 20)
    with pytest.raises(KVTransferError) as refused:
        _receive(second_header, [messages[0], messages[1], messages[0], *messages[2:]], TOKENS, None)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and second_header.state is TransferState.FAILED


_OWNER_THAT_EXITS = """
import os, sys
from kv_wire import segments
unlinked, real_unlink = open(sys.argv[1], "a"), os.unlink
def unlink(path, *args, **kwargs):  # records the order names leave /dev/shm
    real_unlink(path, *args, **kwargs)
    unlinked.write(os.path.basename(path) + "\\n")
    unlinked.flush()
os.unlink = unlink
pool = segments.SegmentPool(keep_bytes=8 << 20)
held, idle = pool.acquire(1), pool.acquire(1)
pool.release(idle)
print(held.name, idle.name, flush=True)
"""


def test_an_owner_that_exits_removes_its_segments_then_its_lock(tmp_path: Path) -> None:
    """The lock used to go first (its exit hook ran before the pool's), and a held segment stayed with no lock:
    a sweep then judged it by its pid, which in another pid namespace (compose: every worker is pid 1 or so) is
    alive, so it stayed for good."""
    # 1. A decode-like process makes two segments, keeps one held and one idle in its pool, and exits normally.
    log = tmp_path / "unlinked"
    child = subprocess.run([sys.executable, "-c", _OWNER_THAT_EXITS, str(log)], capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).parent.parent)
    assert child.returncode == 0, child.stderr
    held, idle = child.stdout.split()
    lock = f"{held[:-8]}.lock"
    # 2. Everything it owned is gone, the lock the last.
    assert not any((segments.SHM_DIR / name).exists() for name in (held, idle, lock))
    order = log.read_text().split()
    assert sorted(order) == sorted([held, idle, lock]) and order[-1] == lock, order
