"""Prefill's channels to decode workers stay bounded as decode addresses come and go (each new pod IP is a new
address): idle ones are closed, a channel with a call in flight never is."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from model_runner.loading import ModelConfig
from prefill_service.config import PrefillConfig
from prefill_service.kv_push import DecodeChannels
from prefill_service.server import PrefillServicer
from protos import prefill_pb2, prefill_pb2_grpc
from serving.server import ServerConfig
from tests.helpers import GREEDY

SHUTDOWN = grpc.ChannelConnectivity.SHUTDOWN


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _until_closed(channels: list[grpc.aio.Channel]) -> None:
    """Eviction closes channels in the background: give it up to 10 s (it takes milliseconds)."""
    deadline = time.monotonic() + 10
    while any(channel.get_state() != SHUTDOWN for channel in channels):
        assert time.monotonic() < deadline, "evicted channels were not closed"
        await asyncio.sleep(0.01)


def test_many_decode_addresses_keep_the_cache_bounded_and_a_call_in_flight_alive() -> None:
    async def run() -> None:
        # 1. A decode-like server whose streaming call (health Watch) stays open, reached through the cache.
        server = grpc.aio.server()
        watched = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(watched, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        clock = _Clock()
        cache = DecodeChannels(grpc.aio.insecure_channel, clock=clock)
        try:
            busy = cache.acquire(address)
            watch = health_pb2_grpc.HealthStub(busy).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            # 2. 600 other decode addresses, one transfer each, a second apart: at most 256 channels stay.
            made = []
            for i in range(600):
                other = f"127.0.{i // 250}.{i % 250 + 1}:1"
                made.append(cache.acquire(other))
                cache.release(other)
                clock.now += 1
                assert len(cache) <= cache.max_channels == 256
            await _until_closed(made[: 600 - 255])  # the least recently used went first
            assert all(channel.get_state() != SHUTDOWN for channel in made[-255:])
            # 3. The call in flight, least recently used of all, survived: it still streams.
            assert busy.get_state() != SHUTDOWN
            await watched.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            # 4. Five idle minutes later, the next transfer closes every idle channel; not the busy one.
            clock.now += cache.max_idle_s + 1
            cache.acquire("127.0.9.9:1")
            cache.release("127.0.9.9:1")
            await _until_closed(made[-255:])
            assert len(cache) == 2 and busy.get_state() != SHUTDOWN
            # 5. Its transfer over and idle as long, it goes too; close() closes the rest.
            watch.cancel()
            cache.release(address)
            clock.now += cache.max_idle_s + 1
            last = cache.acquire("127.0.9.10:1")
            await _until_closed([busy])
            assert len(cache) == 1  # the new one alone
            cache.release("127.0.9.10:1")
            await cache.close()
            assert last.get_state() == SHUTDOWN and len(cache) == 0
        finally:
            await cache.close()
            await server.stop(None)

    asyncio.run(run())


@pytest.fixture(scope="module")
def prefill(tiny_model_dir: Path) -> PrefillServicer:
    model = ModelConfig(model=str(tiny_model_dir))
    return PrefillServicer(PrefillConfig(server=ServerConfig(), model=model, prefix_cache_mb=0), model.load())


def test_the_prefill_service_lets_go_of_channels_to_decode_workers_that_went_away(prefill: PrefillServicer) -> None:
    """Each request to a decode address nobody listens on (a pod gone) ends UNAVAILABLE; its channel stays
    cached only within the cap. (Before, every address ever named kept a channel for the worker's life.)"""

    async def run() -> None:
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(prefill, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        prefill.worker.channels.max_channels = 3
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = prefill_pb2_grpc.PrefillStub(channel)
                for i in range(8):
                    request = prefill_pb2.PrefillRequest(
                        request_id=f"r{i}", token_ids=[5, 6, 7, 8, 9], sampling=GREEDY,
                        decode_address=f"127.0.1.{i + 1}:1", reservation_token="t", shm_segment="")
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for _ in stub.Prefill(request, timeout=60):
                            pass
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
                    assert len(prefill.worker.channels) <= 3
        finally:
            await server.stop(None)
            await prefill.worker.close()

    asyncio.run(run())


def test_a_kv_push_whose_call_decode_ended_stops_reading_its_stream_once_cancelled() -> None:
    """Decode refuses (or releases) a transfer mid-stream: the call ends, but gRPC's task reading the request
    stream still waits for a next layer. The push's cancel ends the stream, so no task is left pending until the
    garbage collector finds it (asyncio then logs "Task was destroyed but it is pending!")."""
    import threading

    import torch

    from decode_service.handlers import SERVICE
    from kv_wire import codec
    from kv_wire.layout import KVLayout
    from kv_wire.sender import KVSender
    from prefill_service.kv_push import KVPush
    from protos import kv_transfer_pb2

    layout = KVLayout(2, 2, 8, 5, "float32")
    kv = torch.zeros(layout.tensor_shape)
    sent = 1 + len(list(KVSender("r1", "token", "fp", layout, 64).encode([(0, kv, kv)])))  # header and layer 0

    async def refuse(request_iterator, context):  # decode, refusing the stream once all it was sent is in
        messages = aiter(request_iterator)
        for _ in range(sent):
            await anext(messages)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no live reservation")

    def readers() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if "_consume_request_iterator" in repr(t.get_coro())]

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "TransferKV": grpc.stream_unary_rpc_method_handler(
                refuse, request_deserializer=codec.decode,
                response_serializer=kv_transfer_pb2.KVTransferAck.SerializeToString)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            push = KVPush(channel, KVSender("r1", "token", "fp", layout, 64), threading.Event())
            push.deliver((0, kv, kv))
            assert push.call is not None
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(push.call, 30)
            assert readers()  # the call is over; gRPC's reader of the stream, all sent, waits for a next layer
            push.cancel()
            for _ in range(100):
                if not readers():
                    break
                await asyncio.sleep(0.01)
            assert not readers()
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(run())
