"""The gateway's view of the worker pools: channels, model agreement, and which worker takes the next request."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

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

    def failed(self) -> None:
        """The worker was unreachable or broke a request: open its breaker (it is still tried as a last resort)."""
        self.failures += 1
        self.suspect_until = time.monotonic() + min(BREAKER_MAX_OPEN_S, BREAKER_OPEN_S * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        self.failures, self.suspect_until = 0, 0.0


class Pool:
    """Workers of one role, taken in round-robin order; a worker whose breaker is open goes last."""

    def __init__(self, role: str, addresses: list[str]) -> None:
        stub_class = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.role = role
        self.workers = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=options)
            self.workers.append(Worker(address, channel, stub_class(channel)))
        self._turn = itertools.count()

    def in_turn(self, avoid: frozenset[str] = frozenset()) -> list[Worker]:
        """Every worker once, starting from the next one in round-robin order. Workers whose breaker is open, and
        then those in `avoid` (addresses that failed this request), go last."""
        start = next(self._turn) % len(self.workers)
        now = time.monotonic()
        ordered = self.workers[start:] + self.workers[:start]
        return sorted(ordered, key=lambda w: (w.address in avoid, w.suspect_until > now))  # stable

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
