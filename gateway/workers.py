"""The gateway's view of the worker pools: channels, model agreement, and which worker takes the next request."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.breakers import Breaker
from gateway.prefix_index import PrefixIndex
from protos import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from protos.types import block_names
from serving.server import MESSAGE_LIMITS
from serving.settings import check_settings, setting
from serving.tls import TLS, aio_channel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive on every worker channel: a ping every `time_s`, and a peer that does not answer within
    `timeout_s` (a frozen process, a black-holed link) has its connection closed, so its calls fail with
    UNAVAILABLE instead of waiting forever. Pings go out with or without calls and however long no data moved
    (a first token can wait long in a prefill queue). The workers must accept pings this often."""

    time_s: float = setting(20.0, "seconds between HTTP/2 pings on each worker channel", flag="--keepalive",
                            above=0)  # as the workers ping their own idle peers (serving/server.py)
    timeout_s: float = setting(10.0, "seconds a worker has to answer a ping before its connection is closed and its "
                               "calls fail over", flag="--keepalive-timeout", above=0)

    def __post_init__(self) -> None:
        check_settings(self)

    def options(self) -> list[tuple[str, int]]:
        timeout_ms = int(self.timeout_s * 1000)
        return [("grpc.keepalive_time_ms", int(self.time_s * 1000)),
                ("grpc.keepalive_timeout_ms", timeout_ms),
                # grpcio 1.85 waits this long for a keepalive ping's ack, whatever keepalive_timeout_ms says
                # (default 60 s; a frozen peer was found only after it, measured)
                ("grpc.http2.ping_timeout_ms", timeout_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]  # default 2: a read-only stream would stop pinging


@dataclass
class Worker:
    address: str
    channel: grpc.aio.Channel
    stub: Any  # PrefillStub or DecodeStub
    info: worker_pb2.WorkerInfo | None = None
    breaker: Breaker = field(default_factory=Breaker)  # open: the worker goes last
    health: Any = None  # grpc.health.v1 stub
    serving: bool = True  # its health check says SERVING (False while it drains or is unreachable)
    picked: int = 0  # requests sent its way since `info` was read: the load the next poll will show
    picked_s: float = 0.0  # predicted seconds of prompt work sent its way since `info` was read (placement.py)
    picked_short_s: float = 0.0  # the part of it that is short prompts (a chunk at most)
    prefilling_tokens: int = 0  # prefill: prompt tokens this gateway sent that have no first token yet
    calls: int = 0  # request calls open on its channel (journey.run counts them)

    def load(self) -> tuple[float, ...]:
        """Lower is better. Decode: running and reserved sequences, then the share of the KV budget in use.
        Prefill: prompt tokens queued or running: what the last poll read, or what this gateway has in flight
        there if more (a fresher count, which misses other gateways' requests). Both count the requests sent
        since the last poll."""
        info = self.info
        if info is None:
            return (float(self.picked),)
        if info.role == "decode":
            used = info.live_kv_bytes / info.kv_budget_bytes if info.kv_budget_bytes else 0.0
            return (float(info.live_sequences + info.live_reservations + self.picked), used)
        return (float(max(info.queued_tokens, self.prefilling_tokens)), float(info.live_sequences + self.picked))

    @property
    def prefix_block_tokens(self) -> int:
        """The size of the worker's prefix-cache blocks (WorkerInfo); 0: it caches no prefixes, or is not known."""
        return self.info.prefix_block_tokens if self.info is not None else 0

    def failed(self) -> None:
        """The worker was unreachable or broke a request: open its breaker (it is still tried as a last resort)."""
        self.breaker.failed()

    def succeeded(self) -> None:
        self.breaker.succeeded()

    @property
    def failures(self) -> int:  # consecutive
        return self.breaker.failures

    @property
    def suspect_until(self) -> float:  # monotonic time; until then the worker goes last
        return self.breaker.open_until


Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (a DNS name of a worker pool resolves to many)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class Colocation:
    """Which prompts go to a decode worker that prefills them itself (conditional disaggregation): those shorter
    than `below` tokens, and only while the prefill pool is busy, its least loaded worker holding at least `queued`
    prompt tokens queued or running, or none of its workers serving. A short prompt then skips a queue behind a
    document, and one sent while prefill is idle costs the decode batch nothing (docs/architecture.md). The journey
    asks again for every attempt: a migrated stream's prompt holds the tokens sent, and may be long by then."""

    below: int = 0  # 0: never (but for a gateway with no prefill workers)
    queued: int = 0  # 0: every prompt under `below`

    def applies(self, prompt_tokens: int, prefill: Pool) -> bool:
        if not prefill.workers:
            return True
        return prompt_tokens < self.below and prefill.least_queued_tokens() >= self.queued


class Pool:
    """Workers of one role, least loaded first (round robin among equals). A worker that drains (health
    NOT_SERVING) or whose breaker is open goes last: it is still tried when nothing else is left.

    An address may name a host that resolves to several workers: the pool holds one worker per address it
    resolves to, and `refresh` re-resolves it, adding workers (unused until a poll finds them serving the
    pool's model) and dropping workers that are gone."""

    def __init__(self, role: str, addresses: list[str], resolver: Resolver = resolve, tls: TLS | None = None,
                 prefix_balance_tokens: int = -1, keepalive: Keepalive = Keepalive()) -> None:
        self.role = role
        self.keepalive = keepalive
        # Prefill pools: requests go to the worker most likely to hold their prefix while its queue is within
        # this many tokens of the least loaded worker's; -1: by load alone.
        self.prefix_balance_tokens = prefix_balance_tokens
        self.tls = tls  # mutual TLS to the workers, each checked to hold a certificate for `role`
        self.names = addresses
        self._resolver = resolver
        self.workers: list[Worker] = []
        self.leaving: list[Worker] = []  # workers gone from DNS whose calls still run: channels closed once done
        self.fingerprint = ""  # the model every worker must serve, once known
        self._turn = itertools.count()
        self._resolved: dict[str, list[str]] = {}  # name -> the addresses it last resolved to
        self.prefixes = PrefixIndex()
        for address in self._resolve():
            self.workers.append(self._worker(address))

    def _worker(self, address: str) -> Worker:
        stub_class = prefill_pb2_grpc.PrefillStub if self.role == "prefill" else decode_pb2_grpc.DecodeStub
        channel = aio_channel(address, self.tls, MESSAGE_LIMITS + self.keepalive.options(), expect=self.role)
        return Worker(address, channel, stub_class(channel), health=health_pb2_grpc.HealthStub(channel))

    def _resolve(self) -> list[str]:
        addresses: list[str] = []
        for name in self.names:
            host, _, port = name.rpartition(":")
            try:
                ipaddress.ip_address(host.strip("[]"))
                found = [name]  # an IP literal: one worker
            except ValueError:
                try:
                    found = [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                             for ip in self._resolver(host, int(port))]
                except OSError as exc:  # unresolvable now: keep what it resolved to before
                    log.warning("%s pool %s: %s", self.role, name, exc)
                    found = self._resolved.get(name, [])
            self._resolved[name] = found
            addresses += [address for address in found if address not in addresses]
        return addresses

    async def refresh(self) -> None:
        """Re-resolve the pool's names: new addresses join (serving once polled), vanished ones leave.

        A worker that leaves takes no new requests, but its channel stays open while requests still stream on it
        (as gRPC and Envoy drain): closing it would cut them. A worker gone for real fails them (UNAVAILABLE, or
        silent past the idle timeout) and they migrate; one only out of DNS (scaled down, rolled) finishes them."""
        current = {w.address: w for w in self.workers}
        wanted = self._resolve()
        for address in wanted:
            if address not in current:
                worker = self._worker(address)
                worker.serving = False  # until a poll finds it healthy and serving the pool's model
                self.workers.append(worker)
                log.info("%s worker %s joined the pool", self.role, address)
        for address, worker in current.items():
            if address not in wanted and len(self.workers) > 1:
                self.workers.remove(worker)
                self.prefixes.forget(address)
                self.leaving.append(worker)
                log.info("%s worker %s left the pool%s", self.role, address,
                         f"; its channel closes once its {worker.calls} calls end" if worker.calls else "")
        await self._close_left()

    async def _close_left(self) -> None:
        """Close the channels of workers that left the pool once no call runs on them."""
        done = [worker for worker in self.leaving if not worker.calls]
        self.leaving = [worker for worker in self.leaving if worker.calls]
        for worker in done:
            await worker.channel.close()

    def in_turn(self, avoid: frozenset[str] = frozenset(), prompt: Sequence[int] = (),
                cache_salt: str = "") -> list[Worker]:
        """Every worker once, best first: not in `avoid` (addresses that failed this request), serving, breaker
        closed, least loaded; ties in round-robin order. The first is counted as picked.

        With a `prompt` (prefill) and `prefix_balance_tokens` >= 0, the worker most likely to hold the prompt's
        longest prefix goes first instead, as long as its load is within `prefix_balance_tokens` queued tokens of
        the least loaded worker's: a hot prefix spills to other workers rather than queue on one. Prefixes are named
        under `cache_salt`, as the workers cache them: a prompt is never steered by another salt's prefix."""
        start = next(self._turn) % len(self.workers)
        now = time.monotonic()
        ordered = self.workers[start:] + self.workers[:start]

        def healthy(w: Worker) -> bool:  # serving, breaker closed
            return w.serving and not w.breaker.is_open(now)

        ordered.sort(key=lambda w: (w.address in avoid, not healthy(w), w.load()))  # stable
        if prompt and self.prefix_balance_tokens >= 0:
            self._prefix_first(ordered, [w for w in ordered if w.address not in avoid and healthy(w)], prompt,
                               cache_salt)
        ordered[0].picked += 1
        return ordered

    def _prefix_first(self, ordered: list[Worker], eligible: list[Worker], prompt: Sequence[int],
                      cache_salt: str) -> None:
        """Move the eligible worker most likely to hold the prompt's longest prefix to the front of `ordered`, if its
        load is within prefix_balance_tokens of the least loaded one's; then record the prompt's blocks as sent to
        whichever worker is first."""
        blocks: dict[int, list[bytes]] = {}  # block size -> the prompt's names; a pool's workers share one size

        def names(w: Worker) -> list[bytes]:
            size = w.prefix_block_tokens  # as that worker's GetInfo said
            if size not in blocks:
                blocks[size] = block_names(prompt, size, cache_salt) if size else []
            return blocks[size]

        home = self.prefixes.best([(w.address, names(w)) for w in eligible])
        worker = next((w for w in eligible if w.address == home), None)
        if worker is not None and worker.load()[0] <= eligible[0].load()[0] + self.prefix_balance_tokens:
            ordered.remove(worker)
            ordered.insert(0, worker)
        self.prefixes.record(ordered[0].address, names(ordered[0]))

    def cached_tokens(self, prompt: Sequence[int], cache_salt: str = "") -> dict[str, int]:
        """By worker address: the prompt tokens each worker likely holds in its prefix cache, by the prefixes this
        pool sent it (0 where it caches none; empty when prefix routing is off); never the whole prompt, whose
        last token is always computed. The prompt's block names are hashed once per block size."""
        if self.prefix_balance_tokens < 0 or not prompt:
            return {}
        names: dict[int, list[bytes]] = {}  # block size -> the prompt's names
        held = {}
        for worker in self.workers:
            size = worker.prefix_block_tokens
            if not size or len(prompt) < size:
                continue
            if size not in names:
                names[size] = block_names(prompt, size, cache_salt)
            held[worker.address] = min(self.prefixes.matched(worker.address, names[size]) * size, len(prompt) - 1)
        return held

    def least_queued_tokens(self) -> float:
        """Prefill: the prompt tokens queued or running at the least loaded worker that serves with its breaker
        closed (as Worker.load counts them); infinite when there is none."""
        now = time.monotonic()
        return min((w.load()[0] for w in self.workers if w.serving and not w.breaker.is_open(now)),
                   default=math.inf)

    async def poll(self, every_s: float, resolve_every_s: float = 30.0) -> None:
        """Forever: each worker's health and load, every `every_s`, and the pool's names re-resolved every
        `resolve_every_s` (run as a task; cancel it to stop)."""
        loop = asyncio.get_running_loop()
        resolved_at = loop.time()
        while True:
            if loop.time() - resolved_at >= resolve_every_s:
                await self.refresh()
                resolved_at = loop.time()
            await self._close_left()
            await asyncio.gather(*(self._poll_one(w, every_s) for w in list(self.workers)))
            await asyncio.sleep(every_s)

    async def _poll_one(self, worker: Worker, timeout_s: float) -> None:
        try:
            health = await worker.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            info = await worker.stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=timeout_s)
            if self.fingerprint and info.model.fingerprint != self.fingerprint:
                if worker.serving or worker.info is None:
                    log.error("%s worker %s serves another model (%s %s): not used", self.role, worker.address,
                              info.model.name, info.model.dtype)
                worker.info, worker.serving = info, False
                return
            worker.serving = health.status == health_pb2.HealthCheckResponse.SERVING
            worker.info, worker.picked, worker.picked_s, worker.picked_short_s = info, 0, 0.0, 0.0
        except grpc.aio.AioRpcError as exc:
            if worker.serving:
                log.warning("%s worker %s: %s", self.role, worker.address, exc.details())
            worker.serving = False

    async def fetch_info(self, timeout_s: float, stragglers_s: float = 10.0) -> None:
        """Wait until a worker answers GetInfo (they may still be loading the model), and give the rest
        `stragglers_s` more: one that has not answered by then starts out of rotation, until a poll finds it."""
        loop = asyncio.get_running_loop()

        async def one(worker: Worker, deadline: float) -> None:
            while True:
                try:
                    worker.info = await worker.stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5,
                                                            wait_for_ready=True)
                    return
                except grpc.aio.AioRpcError as exc:
                    if loop.time() > deadline:
                        raise RuntimeError(
                            f"{self.role} worker {worker.address} did not answer: {exc.details()}") from None
                    await asyncio.sleep(0.5)

        deadline = loop.time() + timeout_s
        asks = {asyncio.ensure_future(one(w, deadline)): w for w in self.workers}
        try:
            pending = set(asks)
            while pending and not any(w.info for w in self.workers):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not any(w.info for w in self.workers) and not pending:
                    next(iter(done)).result()  # nobody answered: raise the last refusal
            if pending:
                await asyncio.wait(pending, timeout=stragglers_s)
        finally:
            for ask in asks:
                ask.cancel()
        for worker in self.workers:
            if worker.info is None:
                worker.serving = False
                log.warning("%s worker %s has not answered yet; out of rotation until it does", self.role,
                            worker.address)

    async def close(self) -> None:
        for worker in self.workers + self.leaving:
            await worker.channel.close()


def check_pairing(prefill: Pool, decode: Pool) -> worker_pb2.ModelInfo:
    """Prefill and decode must serve the same model, revision and dtype; returns that model."""
    workers = [w for w in prefill.workers + decode.workers if w.info is not None]
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
    prefill.fingerprint = decode.fingerprint = first.model.fingerprint  # workers that join later must match
    return first.model
