"""The decode worker's side of the handoff, driven by hand: reservations, refused KV streams, leases, capacity."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from kv_wire import codec, segments
from kv_wire.layout import KVLayout
from kv_wire.segments import SegmentMaps, SegmentView
from kv_wire.sender import KVSender
from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, worker_pb2
from tests.conftest import assert_nothing_held

PROMPT_TOKENS = 6
GREEDY = worker_pb2.SamplingParams(temperature=0.0, top_p=1.0)


@pytest.fixture
def decode(tiny_cluster: Cluster):
    with grpc.insecure_channel(tiny_cluster.decode[0].address) as channel:
        yield decode_pb2_grpc.DecodeStub(channel)
    assert_nothing_held(tiny_cluster)


def _reserve(stub, request_id: str, max_tokens: int = 4):
    call = stub.Generate(decode_pb2.DecodeRequest(request_id=request_id, prompt_tokens=PROMPT_TOKENS,
                                                  max_tokens=max_tokens, sampling=GREEDY), timeout=30)
    return call, next(call).reserved.token


def _layout(stub) -> tuple[worker_pb2.ModelInfo, KVLayout]:
    model = stub.GetInfo(worker_pb2.WorkerInfoRequest()).model
    return model, KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, PROMPT_TOKENS, model.dtype)


def _kv_stream(stub, request_id: str, token: str, fingerprint: str | None = None, segment: SegmentView | None = None,
               layers: int | None = None) -> list[kv_transfer_pb2.KVTransfer]:
    """As prefill sends it, one layer at a time as each is produced; into `segment` if given (descriptors on the
    wire). With `layers`, only that many layers are sent, and the stream stops there (a writer that never
    finished)."""
    model, layout = _layout(stub)
    sender = KVSender(request_id, token, fingerprint or model.fingerprint, layout, chunk_bytes=256, segment=segment)
    messages = [sender.header()]
    for layer in range(model.num_layers if layers is None else layers):
        chunks = sender.encode([(layer, torch.randn(layout.tensor_shape), torch.randn(layout.tensor_shape))])
        messages += map(kv_transfer_pb2.KVTransfer.FromString, chunks)
    return messages + ([sender.trailer(first_token=42)] if layers is None else [])


def _shm_kv_stream(stub, request_id: str, token: str, segment: str, layers: int | None = None):
    """_kv_stream written into the reservation's lent segment, and the segment as this process opened it."""
    lent = SegmentMaps().open(segment, token, _layout(stub)[1].total_bytes)
    assert lent is not None, "the reservation's segment opens from this process"
    return _kv_stream(stub, request_id, token, segment=lent, layers=layers), lent


def _refused(call_kv, messages) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        call_kv(iter(messages), timeout=30)
    return refused.value.code()


def _stream_failure(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failed:
        list(call)
    return failed.value.code()


def test_valid_handoff_streams_tokens(decode) -> None:
    call, token = _reserve(decode, "handoff-ok", max_tokens=4)
    ack = decode.TransferKV(iter(_kv_stream(decode, "handoff-ok", token)), timeout=30)
    assert ack.chunks_received > 0
    events = list(call)
    tokens = [t for e in events for t in e.tokens.token_ids]
    assert len(tokens) == 3  # 4 tokens, the first came from "prefill"
    assert events[-1].tokens.finish_reason == "length"


def test_chunks_batched_in_one_message_are_each_checked_and_accepted(decode) -> None:
    call, token = _reserve(decode, "batched", max_tokens=2)
    messages = _kv_stream(decode, "batched", token)
    chunks = [m.chunk for m in messages[1:-1]]
    batches = [kv_transfer_pb2.KVTransfer(chunks=kv_transfer_pb2.KVChunks(chunk=chunks[i : i + 3]))
               for i in range(0, len(chunks), 3)]
    ack = decode.TransferKV(iter([messages[0], *batches, messages[-1]]), timeout=30)
    assert ack.chunks_received == len(chunks) and len(batches) < len(chunks)
    assert list(call)[-1].tokens.finish_reason == "length"


def test_forged_token_is_refused_and_reservation_stays_usable(decode) -> None:
    call, token = _reserve(decode, "forged")
    forged = _kv_stream(decode, "forged", "not-the-token")
    assert _refused(decode.TransferKV, forged) == grpc.StatusCode.PERMISSION_DENIED
    decode.TransferKV(iter(_kv_stream(decode, "forged", token)), timeout=30)  # the real holder still gets through
    assert list(call)[-1].tokens.finish_reason


def test_reused_token_is_refused(decode) -> None:
    call, token = _reserve(decode, "reused")
    messages = _kv_stream(decode, "reused", token)
    decode.TransferKV(iter(messages), timeout=30)
    assert _refused(decode.TransferKV, messages) == grpc.StatusCode.PERMISSION_DENIED
    list(call)


@pytest.mark.parametrize(("damage", "code"), [
    ("fingerprint", grpc.StatusCode.FAILED_PRECONDITION),
    ("checksum", grpc.StatusCode.DATA_LOSS),
    ("no_trailer", grpc.StatusCode.DATA_LOSS),
    ("chunk_first", grpc.StatusCode.INVALID_ARGUMENT),
    ("empty_chunks", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_stream_is_refused_and_fails_the_reservation_at_once(decode, damage: str, code: grpc.StatusCode) -> None:
    call, token = _reserve(decode, f"bad-{damage}")
    fingerprint = "another-model" if damage == "fingerprint" else None
    messages = _kv_stream(decode, f"bad-{damage}", token, fingerprint)
    if damage == "checksum":
        messages[5].chunk.checksum ^= 1
    elif damage == "no_trailer":
        messages = messages[:-1]
    elif damage == "chunk_first":
        messages = messages[1:]
    elif damage == "empty_chunks":
        messages.insert(3, kv_transfer_pb2.KVTransfer(chunks=kv_transfer_pb2.KVChunks()))
    assert _refused(decode.TransferKV, messages) == code
    assert _stream_failure(call) == (grpc.StatusCode.DEADLINE_EXCEEDED if damage == "chunk_first" else code)


def test_undecodable_message_mid_stream_is_invalid_argument(decode, tiny_cluster: Cluster) -> None:
    call, token = _reserve(decode, "garbage")
    messages = [m.SerializeToString() for m in _kv_stream(decode, "garbage", token)]
    messages[3] = b"\xff\xff\xff"
    with grpc.insecure_channel(tiny_cluster.decode[0].address) as channel:
        raw = channel.stream_unary(codec.TRANSFER_KV_METHOD)  # bytes as they are, past any serializer
        assert _refused(raw, messages) == grpc.StatusCode.INVALID_ARGUMENT
    assert _stream_failure(call) == grpc.StatusCode.INVALID_ARGUMENT


def test_released_reservation_ends_its_stalled_kv_stream_at_once(decode) -> None:
    call, token = _reserve(decode, "released-mid-stream")
    messages = _kv_stream(decode, "released-mid-stream", token)
    unblock = threading.Event()

    def header_then_stall():
        yield from messages[:3]
        unblock.wait(30)  # a sender that stopped sending

    transfer = decode.TransferKV.future(header_then_stall(), timeout=30)
    try:
        time.sleep(0.5)  # the header and two chunks are in
        started = time.monotonic()
        call.cancel()  # the gateway gives up on the request
        with pytest.raises(grpc.RpcError) as ended:
            transfer.result(timeout=10)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - started < 2.0  # not at the 3 s lease
    finally:
        unblock.set()


def test_reservation_whose_kv_never_arrives_expires_with_its_lease(decode) -> None:
    call, _ = _reserve(decode, "never-sent")  # the tiny cluster's lease is 3 s
    assert _stream_failure(call) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_full_worker_refuses_reservations_and_gateway_uses_the_other(decode, tiny_cluster: Cluster) -> None:
    held = [_reserve(decode, f"fill-{i}") for i in range(4)]  # --max-seqs=4
    with pytest.raises(grpc.RpcError) as full:
        _reserve(decode, "one-too-many")
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for _ in range(2):  # round robin would pick the full worker for one of these
        assert generate(tiny_cluster.gateway.address, timeout=30, prompt="Hi", max_tokens=2).finish_reason
    for call, _ in held:
        call.cancel()


def test_bad_decode_request_is_invalid_argument(decode) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        next(decode.Generate(decode_pb2.DecodeRequest(request_id="x", prompt_tokens=0, max_tokens=1, sampling=GREEDY),
                             timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_cancelled_while_its_segment_is_being_made_gets_it_back(tiny_model_dir: Path) -> None:
    """The cancel storm found this: the segment's thread finished after the request had gone, and nobody
    returned the segment to its pool."""
    from decode_service.reservations import DecodeParams
    from decode_service.server import DecodeConfig, DecodeServicer
    from model_runner.loading import ModelConfig
    from model_runner.sampling import SamplingParams
    from serving.server import ServerConfig

    config = DecodeConfig(server=ServerConfig(), model=ModelConfig(model=str(tiny_model_dir)), kv_warm_mb=0)
    servicer = DecodeServicer(config, config.model.load())
    pool = servicer.lender.pool
    assert pool is not None
    made = threading.Event()

    def slow_acquire(nbytes: int) -> object:
        time.sleep(0.3)
        try:
            return type(pool).acquire(pool, nbytes)
        finally:
            made.set()

    pool.acquire = slow_acquire  # type: ignore[method-assign]

    async def cancel_mid_acquire() -> None:
        reservation = servicer.table.reserve(DecodeParams("r", 8, 4, SamplingParams(temperature=0.0), False))
        lending = asyncio.ensure_future(servicer.lender.lend(reservation))
        await asyncio.sleep(0.05)
        lending.cancel()
        await asyncio.gather(lending, return_exceptions=True)
        assert await asyncio.to_thread(made.wait, 5)
        await asyncio.sleep(0.05)  # the done callback runs on the loop
        servicer.table.release(reservation)

    try:
        asyncio.run(cancel_mid_acquire())
        assert pool.held_bytes == 0
    finally:
        pool.close()


def test_admitted_kv_gives_its_segment_back_and_an_unfinished_writer_retires_its_segment(decode) -> None:
    def reserve(request_id: str):
        call = decode.Generate(decode_pb2.DecodeRequest(request_id=request_id, prompt_tokens=PROMPT_TOKENS,
                                                        max_tokens=2, sampling=GREEDY), timeout=30)
        reserved = next(call).reserved
        assert reserved.shm_segment, "a decode worker on this host lends a segment"
        return call, reserved

    # KV admitted from shared memory: read from the segment until it joined, then lent to the next request.
    call, reserved = reserve("segment-admitted")
    messages, _ = _shm_kv_stream(decode, "segment-admitted", reserved.token, reserved.shm_segment)
    decode.TransferKV(iter(messages), timeout=30)
    assert len([t for e in call for t in e.tokens.token_ids]) == 1  # max_tokens 2: the first came with the KV
    call, again = reserve("segment-reused")
    assert again.shm_segment == reserved.shm_segment

    # A writer that wrote a layer and never finished: the request ends, and its segment is never lent again.
    _, lent = _shm_kv_stream(decode, "segment-reused", again.token, again.shm_segment, layers=1)
    call.cancel()
    path = segments.SHM_DIR / again.shm_segment
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not path.exists(), "the unfinished transfer's segment was retired"
    assert not lent.still_lent()  # and the writer, between layers, sees it was taken back
    lent.data[:] = 0xFF  # the late writer's bytes land where nobody reads them
    call, fresh = reserve("after-the-retirement")
    assert fresh.shm_segment != again.shm_segment
    messages, _ = _shm_kv_stream(decode, "after-the-retirement", fresh.token, fresh.shm_segment)
    decode.TransferKV(iter(messages), timeout=30)
    assert len([t for e in call for t in e.tokens.token_ids]) == 1  # max_tokens 2: the first came with the KV
