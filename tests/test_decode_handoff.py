"""The decode worker's side of the handoff, driven by hand: reservations, refused KV streams, leases, capacity."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kv_wire import codec, segments
from kv_wire.segments import SegmentMaps
from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, prefill_pb2, prefill_pb2_grpc, worker_pb2
from tests.helpers import GREEDY, PROMPT_TOKENS, assert_nothing_live, kv_layout, kv_stream, reserve, wait_until

pytestmark = pytest.mark.leak_check("tiny_cluster")  # and the lifecycle tests end in the gauges' own check


@pytest.fixture
def decode(tiny_cluster: Cluster) -> Iterator[decode_pb2_grpc.DecodeStub]:
    with grpc.insecure_channel(tiny_cluster.decode[0].address) as channel:
        yield decode_pb2_grpc.DecodeStub(channel)


def _live_transfers(stub: decode_pb2_grpc.DecodeStub) -> int:
    return stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5).live_transfers


def _shm_kv_stream(stub, request_id: str, token: str, segment: str, layers: int | None = None):
    """kv_stream written into the reservation's lent segment, and the segment as this process opened it."""
    lent = SegmentMaps().open(segment, token, kv_layout(stub)[1].total_bytes)
    assert lent is not None, "the reservation's segment opens from this process"
    return kv_stream(stub, request_id, token, segment=lent, layers=layers), lent


def _refused(call_kv, messages) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        call_kv(iter(messages), timeout=30)
    return refused.value.code()


def _stream_failure(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failed:
        list(call)
    return failed.value.code()


def test_valid_handoff_streams_tokens(decode, tiny_cluster: Cluster) -> None:
    # 1. Reserve: a slot and KV for the prompt, held under a token.
    call, token = reserve(decode, "handoff-ok", max_tokens=4)
    assert decode.GetInfo(worker_pb2.WorkerInfoRequest()).live_reservations == 1
    # 2. Transfer: the KV stream presenting the token is accepted whole, and admitted.
    ack = decode.TransferKV(iter(kv_stream(decode, "handoff-ok", token)), timeout=30)
    assert ack.chunks_received > 0
    # 3. Stream: the tokens after the first, which came from "prefill", and the finish reason.
    events = list(call)
    tokens = [t for e in events for t in e.tokens.token_ids]
    assert len(tokens) == 3  # 4 tokens, the first came from "prefill"
    assert events[-1].tokens.finish_reason == "length"
    # 4. Leak check: every live gauge is back at zero.
    assert_nothing_live(tiny_cluster)


def test_chunks_batched_in_one_message_are_each_checked_and_accepted(decode) -> None:
    call, token = reserve(decode, "batched", max_tokens=2)
    messages = kv_stream(decode, "batched", token)
    chunks = [m.chunk for m in messages[1:-1]]
    batches = [kv_transfer_pb2.KVTransfer(chunks=kv_transfer_pb2.KVChunks(chunk=chunks[i : i + 3]))
               for i in range(0, len(chunks), 3)]
    ack = decode.TransferKV(iter([messages[0], *batches, messages[-1]]), timeout=30)
    assert ack.chunks_received == len(chunks) and len(batches) < len(chunks)
    assert list(call)[-1].tokens.finish_reason == "length"


def test_forged_token_is_refused_and_reservation_stays_usable(decode, tiny_cluster: Cluster) -> None:
    # 1. Reserve.
    call, token = reserve(decode, "forged")
    # 2. A stream with a forged token is refused, and the reservation is untouched.
    forged = kv_stream(decode, "forged", "not-the-token")
    assert _refused(decode.TransferKV, forged) == grpc.StatusCode.PERMISSION_DENIED
    # 3. The real holder still gets through, and the tokens stream to the end.
    decode.TransferKV(iter(kv_stream(decode, "forged", token)), timeout=30)
    assert list(call)[-1].tokens.finish_reason
    # 4. Leak check.
    assert_nothing_live(tiny_cluster)


def test_reused_token_is_refused(decode) -> None:
    call, token = reserve(decode, "reused")
    messages = kv_stream(decode, "reused", token)
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
    call, token = reserve(decode, f"bad-{damage}")
    fingerprint = "another-model" if damage == "fingerprint" else None
    messages = kv_stream(decode, f"bad-{damage}", token, fingerprint)
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
    call, token = reserve(decode, "garbage")
    messages = [m.SerializeToString() for m in kv_stream(decode, "garbage", token)]
    messages[3] = b"\xff\xff\xff"
    with grpc.insecure_channel(tiny_cluster.decode[0].address) as channel:
        raw = channel.stream_unary(codec.TRANSFER_KV_METHOD)  # bytes as they are, past any serializer
        assert _refused(raw, messages) == grpc.StatusCode.INVALID_ARGUMENT
    assert _stream_failure(call) == grpc.StatusCode.INVALID_ARGUMENT


def test_released_reservation_ends_its_stalled_kv_stream_at_once(decode, tiny_cluster: Cluster) -> None:
    # 1. Reserve.
    call, token = reserve(decode, "released-mid-stream")
    messages = kv_stream(decode, "released-mid-stream", token)
    unblock = threading.Event()

    def header_then_stall():
        yield from messages[:3]
        unblock.wait(30)  # a sender that stopped sending

    # 2. Transfer the header and two chunks, then stall: the stream has claimed the reservation.
    transfer = decode.TransferKV.future(header_then_stall(), timeout=30)
    try:
        wait_until(lambda: _live_transfers(decode) == 1, "the KV stream to claim its reservation")
        # 3. Cancel: the gateway gives up on the request, and the stalled stream ends for the release, not at the
        #    3 s lease (which would end it DEADLINE_EXCEEDED, "not complete before the reservation's lease ended").
        call.cancel()
        with pytest.raises(grpc.RpcError) as ended:
            transfer.result(timeout=30)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert "was released during the transfer" in (ended.value.details() or "")
    finally:
        unblock.set()
    # 4. Leak check.
    assert_nothing_live(tiny_cluster)


def test_reservation_whose_kv_never_arrives_expires_with_its_lease(decode, tiny_cluster: Cluster) -> None:
    # 1. Reserve, and send nothing.
    call, _ = reserve(decode, "never-sent")
    # 2. The lease ends (the tiny cluster's is 3 s): the call fails, DEADLINE_EXCEEDED, saying so (the call's own
    # 30 s deadline would end it with the same code).
    with pytest.raises(grpc.RpcError) as expired:
        list(call)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "lease" in expired.value.details()
    # 3. Leak check.
    assert_nothing_live(tiny_cluster)


def test_full_worker_refuses_reservations_and_gateway_uses_the_other(decode, tiny_cluster: Cluster) -> None:
    # 1. Fill the worker: --max-seqs=4.
    held = [reserve(decode, f"fill-{i}") for i in range(4)]
    # 2. A fifth reservation is refused.
    with pytest.raises(grpc.RpcError) as full:
        reserve(decode, "one-too-many")
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # 3. Requests through the gateway go to the other worker.
    for _ in range(2):  # round robin would pick the full worker for one of these
        assert generate(tiny_cluster.gateway.address, timeout=30, prompt="Hi", max_tokens=2).finish_reason
    # 4. Cancel the held reservations.
    for call, _ in held:
        call.cancel()
    # 5. Leak check.
    assert_nothing_live(tiny_cluster)


def test_bad_decode_request_is_invalid_argument(decode) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        next(decode.Generate(decode_pb2.DecodeRequest(request_id="x", prompt_tokens=0, max_tokens=1, sampling=GREEDY),
                             timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # decoded_tokens (a migrated stream's sent tokens) belongs to a colocated request's own prompt
    with pytest.raises(grpc.RpcError) as refused:
        next(decode.Generate(decode_pb2.DecodeRequest(request_id="x", prompt_tokens=4, max_tokens=1, sampling=GREEDY,
                                                      decoded_tokens=2), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs prompt_token_ids" in (refused.value.details() or "")


def test_a_prefill_request_whose_tokens_are_all_decoded_is_invalid_argument(tiny_cluster: Cluster) -> None:
    with grpc.insecure_channel(tiny_cluster.prefill[0].address) as channel:
        prefill = prefill_pb2_grpc.PrefillStub(channel)
        for decoded in (3, 2**32 - 1):
            with pytest.raises(grpc.RpcError) as refused:
                next(prefill.Prefill(prefill_pb2.PrefillRequest(
                    request_id="x", token_ids=[5, 6, 7], sampling=GREEDY, decode_address="127.0.0.1:1",
                    reservation_token="t", decoded_tokens=decoded), timeout=10))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"decoded_tokens ({decoded}) must be fewer than the prompt's 3 tokens" in (
                refused.value.details() or "")
    assert_nothing_live(tiny_cluster)


def test_a_request_cancelled_while_its_segment_is_being_made_gets_it_back(tiny_model_dir: Path) -> None:
    """The cancel storm found this: the segment's thread finished after the request had gone, and nobody
    returned the segment to its pool."""
    from decode_service.config import DecodeConfig
    from decode_service.reservations import DecodeParams
    from decode_service.server import DecodeServicer
    from model_runner.loading import ModelConfig
    from protos.types import SamplingParams
    from serving.server import ServerConfig

    config = DecodeConfig(server=ServerConfig(), model=ModelConfig(model=str(tiny_model_dir)), kv_warm_mb=0)
    servicer = DecodeServicer(config, config.model.load())
    pool = servicer.worker.lender.pool
    assert pool is not None
    acquiring, cancelled, made = threading.Event(), threading.Event(), threading.Event()

    def slow_acquire(nbytes: int) -> object:
        acquiring.set()
        cancelled.wait(30)  # the point of the test: the segment is made only once the cancel has landed
        try:
            return type(pool).acquire(pool, nbytes)
        finally:
            made.set()

    pool.acquire = slow_acquire  # type: ignore[method-assign]

    async def cancel_mid_acquire() -> None:
        # 1. Reserve, and start lending the reservation a segment.
        reservation = servicer.worker.table.reserve(DecodeParams("r", 8, 4, SamplingParams(temperature=0.0), False))
        lending = asyncio.ensure_future(servicer.worker.lender.lend(reservation))
        # 2. Cancel the request while the segment is being made.
        assert await asyncio.to_thread(acquiring.wait, 5)
        lending.cancel()
        await asyncio.gather(lending, return_exceptions=True)
        cancelled.set()
        # 3. The segment is made after all, and goes back to its pool (a done callback, on the loop), before the
        # reservation is released.
        assert await asyncio.to_thread(made.wait, 5)
        await asyncio.to_thread(wait_until, lambda: pool.held_bytes == 0, "the late segment back in its pool",
                                timeout_s=5)
        servicer.worker.table.release(reservation)

    try:
        asyncio.run(cancel_mid_acquire())
        # 4. Leak check: the pool lends nothing.
        assert pool.held_bytes == 0
    finally:
        pool.close()


class _EndingContext:
    """The little of grpc.aio.ServicerContext a reservation's stream uses, and the call's end, run by hand."""

    def __init__(self) -> None:
        self.done_callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.done_callbacks.append(callback)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"not expected here: {code.name} {details}")

    def end(self) -> None:
        for callback in self.done_callbacks:
            callback(self)


def test_a_reservation_is_freed_when_its_call_ends_even_if_its_stream_is_never_closed(tiny_model_dir: Path) -> None:
    """gRPC can stop iterating a stream (a cancel landing while it writes) and drop it unclosed; its own cleanup
    then waits for the garbage collector. The call's end frees the reservation, its KV budget and segment."""
    from decode_service.config import DecodeConfig
    from decode_service.server import DecodeServicer
    from model_runner.loading import ModelConfig
    from serving.server import ServerConfig

    config = DecodeConfig(server=ServerConfig(), model=ModelConfig(model=str(tiny_model_dir)), kv_warm_mb=0)
    servicer = DecodeServicer(config, config.model.load())
    worker, context = servicer.worker, _EndingContext()

    def held() -> tuple[int, int, int]:
        return worker.table.awaiting_kv, worker.table.kv_bytes, worker.lender.lent_bytes

    async def dropped_stream() -> None:
        stream = servicer._generate(decode_pb2.DecodeRequest(
            request_id="dropped", prompt_tokens=PROMPT_TOKENS, max_tokens=4, sampling=GREEDY), context)  # type: ignore[arg-type]
        assert (await stream.__anext__()).WhichOneof("event") == "reserved"
        waiting = asyncio.ensure_future(stream.__anext__())  # in its relay, waiting for KV that never comes
        await asyncio.sleep(0.05)
        assert held()[:2] != (0, 0)
        context.end()  # the call ends; nobody closes the stream
        assert held() == (0, 0, 0)
        waiting.cancel()  # the stream's own cleanup, later, releases nothing twice
        await asyncio.gather(waiting, return_exceptions=True)
        assert held() == (0, 0, 0)

    try:
        asyncio.run(dropped_stream())
    finally:
        worker.lender.close()


def test_admitted_kv_gives_its_segment_back_and_an_unfinished_writer_retires_its_segment(
    decode, tiny_cluster: Cluster
) -> None:
    def reserve_segment(request_id: str):
        call = decode.Generate(decode_pb2.DecodeRequest(request_id=request_id, prompt_tokens=PROMPT_TOKENS,
                                                        max_tokens=2, sampling=GREEDY), timeout=30)
        reserved = next(call).reserved
        assert reserved.shm_segment, "a decode worker on this host lends a segment"
        return call, reserved

    # 1. Reserve: the reservation is lent a shared-memory segment.
    call, reserved = reserve_segment("segment-admitted")
    # 2. Transfer through the segment; admitted, the KV is read from it until it joined, and the request finishes.
    messages, _ = _shm_kv_stream(decode, "segment-admitted", reserved.token, reserved.shm_segment)
    decode.TransferKV(iter(messages), timeout=30)
    assert len([t for e in call for t in e.tokens.token_ids]) == 1  # max_tokens 2: the first came with the KV
    # 3. The segment went back to the pool: the next reservation is lent the same one.
    call, again = reserve_segment("segment-reused")
    assert again.shm_segment == reserved.shm_segment
    # 4. A writer that wrote a layer and never finished, then the request is cancelled: its segment is retired, never
    # lent again.
    _, lent = _shm_kv_stream(decode, "segment-reused", again.token, again.shm_segment, layers=1)
    call.cancel()
    path = segments.SHM_DIR / again.shm_segment
    wait_until(lambda: not path.exists(), "the unfinished transfer's segment to be retired")
    assert not lent.still_lent()  # and the writer, between layers, sees it was taken back
    lent.data[:] = 0xFF  # the late writer's bytes land where nobody reads them
    # 5. The next reservation gets a fresh segment, and its handoff works.
    call, fresh = reserve_segment("after-the-retirement")
    assert fresh.shm_segment != again.shm_segment
    messages, _ = _shm_kv_stream(decode, "after-the-retirement", fresh.token, fresh.shm_segment)
    decode.TransferKV(iter(messages), timeout=30)
    assert len([t for e in call for t in e.tokens.token_ids]) == 1  # max_tokens 2: the first came with the KV
    # 6. Leak check.
    assert_nothing_live(tiny_cluster)
