"""The gateway's view of the worker pools: channels, model agreement, and which worker takes the next request."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.serving import MAX_MESSAGE_BYTES
from protos import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)


BREAKER_OPEN_S = 1.0  # a failed worker is tried last for this long, doubling per consecutive failure
BREAKER_MAX_OPEN_S = 30.0


@dataclass
class Worker:
    address: str
    channel: grpc.aio.Channel
    stub: Any  # PrefillStub or DecodeStub
    info: worker_pb2.WorkerInfo | None = None
    failures: int = 0  # consecutive
    suspect_until: float = 0.0  # monotonic time; until then the worker goes last
    health: Any = None  # grpc.health.v1 stub
    serving: bool = True  # its health check says SERVING (False while it drains or is unreachable)
    picked: int = 0  # requests sent its way since `info` was read: the load the next poll will show

    def load(self) -> tuple[float, ...]:
        """Lower is better. Decode: running and reserved sequences, then the share of the KV budget in use.
        Prefill: prompt tokens queued or running. Both count the requests sent since the last poll."""
        info = self.info
        if info is None:
            return (float(self.picked),)
        if info.role == "decode":
            used = info.live_kv_bytes / info.kv_budget_bytes if info.kv_budget_bytes else 0.0
            return (float(info.live_sequences + info.live_reservations + self.picked), used)
        return (float(info.queued_tokens), float(info.live_sequences + self.picked))

    def failed(self) -> None:
        """The worker was unreachable or broke a request: open its breaker (it is still tried as a last resort)."""
        self.failures += 1
        self.suspect_until = time.monotonic() + min(BREAKER_MAX_OPEN_S, BREAKER_OPEN_S * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        self.failures, self.suspect_until = 0, 0.0


class Pool:
    """Workers of one role, least loaded first (round robin among equals). A worker that drains (health
    NOT_SERVING) or whose breaker is open goes last: it is still tried when nothing else is left."""

    def __init__(self, role: str, addresses: list[str]) -> None:
        stub_class = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.role = role
        self.workers = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=options)
            self.workers.append(Worker(address, channel, stub_class(channel),
                                       health=health_pb2_grpc.HealthStub(channel)))
        self._turn = itertools.count()

    def in_turn(self, avoid: frozenset[str] = frozenset()) -> list[Worker]:
        """Every worker once, best first: not in `avoid` (addresses that failed this request), serving, breaker
        closed, least loaded; ties in round-robin order. The first is counted as picked."""
        start = next(self._turn) % len(self.workers)
        now = time.monotonic()
        ordered = self.workers[start:] + self.workers[:start]
        ordered.sort(key=lambda w: (w.address in avoid, not w.serving or w.suspect_until > now, w.load()))  # stable
        ordered[0].picked += 1
        return ordered

    async def poll(self, every_s: float) -> None:
        """Forever: each worker's health and load, every `every_s` (run as a task; cancel it to stop)."""
        while True:
            await asyncio.gather(*(self._poll_one(w, every_s) for w in self.workers))
            await asyncio.sleep(every_s)

    async def _poll_one(self, worker: Worker, timeout_s: float) -> None:
        try:
            health = await worker.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            worker.serving = health.status == health_pb2.HealthCheckResponse.SERVING
            worker.info, worker.picked = await worker.stub.GetInfo(worker_pb2.WorkerInfoRequest(),
                                                                   timeout=timeout_s), 0
        except grpc.aio.AioRpcError as exc:
            if worker.serving:
                log.warning("%s worker %s: %s", self.role, worker.address, exc.details())
            worker.serving = False

    async def fetch_info(self, timeout_s: float) -> None:
        """Wait until every worker answers GetInfo (they may still be loading the model)."""
        async def one(worker: Worker) -> None:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while True:
                try:
                    worker.info = await worker.stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5,
                                                            wait_for_ready=True)
                    return
                except grpc.aio.AioRpcError as exc:
                    if asyncio.get_running_loop().time() > deadline:
                        raise RuntimeError(
                            f"{self.role} worker {worker.address} did not answer: {exc.details()}") from None
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(one(w) for w in self.workers))

    async def close(self) -> None:
        for worker in self.workers:
            await worker.channel.close()


def check_pairing(prefill: Pool, decode: Pool) -> worker_pb2.ModelInfo:
    """Prefill and decode must serve the same model, revision and dtype; returns that model."""
    workers = prefill.workers + decode.workers
    first = workers[0].info
    assert first is not None
    for worker in workers:
        assert worker.info is not None
        if worker.info.model.fingerprint != first.model.fingerprint:
            raise RuntimeError(
                f"refusing to pair: {worker.info.role} worker {worker.address} serves {worker.info.model.name} "
                f"{worker.info.model.dtype} (fingerprint {worker.info.model.fingerprint}), but "
                f"{first.role} worker {workers[0].address} serves {first.model.name} {first.model.dtype} "
                f"(fingerprint {first.model.fingerprint})")
    return first.model
