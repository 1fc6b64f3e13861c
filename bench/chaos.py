"""`pdserve bench chaos`: the cluster under faults; one experiment per failure, each with its counts and `ok`.

- cancel_storm: requests on a 2-prefill, 2-decode cluster, each cancelled at a random moment (queued, reserving,
  prefilling, transferring or decoding). ok: every live gauge on every service is 0 within 1 s of the last
  cancel, and a normal request succeeds afterwards.
- storm: 200 requests in 4 s on a 2-prefill, 2-decode cluster (prompts of 20 to 900 words, each cancelled at a
  random moment or read to the end). ok: every request ends OK, CANCELLED by its client, or refused for load
  (RESOURCE_EXHAUSTED) before its first token; never DEADLINE_EXCEEDED or any other failure. Every live gauge 0
  within 1 s of the last request's end.
- kill_decode: greedy streams run; one of two decode workers is SIGKILLed once half of them have tokens. ok:
  all complete, token for token identical to an uninterrupted run.
- kill_prefill: requests arrive; one of two prefill workers is SIGKILLed. ok: all complete.
- link_fault: decode workers are reached through fault proxies; one link is reset mid-transfer, the other
  blackholed for 2 s. ok: every request completes (by retry or migration) or fails with a clear status before
  its deadline, and nothing is held afterwards.
- overload: requests arrive at 10x the rate the cluster serves (measured first), for 3 s. ok: the excess is
  refused in under 50 ms (p99), the first admitted requests keep their unloaded TTFT (within 2x), and the
  gateway's memory grows by under 50 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.report import add_output_args, publish
from bench.scenarios import percentile
from bench.soak import model_context
from model_runner.loading import resolve_model
from pdserve.cluster import Cluster, ClusterConfig, Service, spawn_service, start, stop_all, wait_healthy, wait_ready
from pdserve.faults import FaultProxy
from protos import gateway_pb2, gateway_pb2_grpc
from serving.metrics import scrape
from serving.models import DEFAULT_MODEL

LIVE = ("pdserve_live_requests", "pdserve_live_prefills", "pdserve_queued_tokens", "pdserve_live_reservations",
        "pdserve_live_sequences", "pdserve_live_kv_bytes", "pdserve_live_buffer_bytes")
CLEAR_STATUSES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "DATA_LOSS", "INTERNAL", "CANCELLED"}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS), help="which to run (default: all six)")
    parser.add_argument("--cancels", type=int, default=500, help="cancel storm requests (default: %(default)s)")
    parser.add_argument("--storm", type=int, default=200, help="storm requests, sent over 4 s (default: %(default)s)")
    parser.add_argument("--streams", type=int, default=16, help="streams in the kill and link experiments")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per stream (default: %(default)s)")
    add_output_args(parser, "chaos", plot=False)


def run(args: argparse.Namespace) -> int:
    names = [name.strip() for name in args.experiments.split(",") if name.strip()]
    unknown = sorted(set(names) - set(EXPERIMENTS))
    if unknown:
        raise SystemExit(f"pdserve bench chaos: unknown experiment(s) {unknown}; known: {sorted(EXPERIMENTS)}")
    model = str(resolve_model(args.model))
    results: dict[str, Any] = {}
    for name in names:
        results[name] = EXPERIMENTS[name](model, args)
        print(f"bench chaos: {name} ok={results[name]['ok']}", file=sys.stderr, flush=True)
    return publish(args, "chaos", results, lambda: _table(results))


def _cluster(model: str, prefill: int = 2, decode: int = 2, decode_args: tuple[str, ...] = (),
             gateway_args: tuple[str, ...] = ()) -> Cluster:
    # every prompt disaggregated (--placement threshold, nothing colocated): each experiment breaks a known path
    return start(ClusterConfig(prefill=prefill, decode=decode, model=model, threads=1, startup_timeout_s=300,
                               colocate_below=0, decode_args=decode_args,
                               gateway_args=("--placement=threshold", *gateway_args)))


def _held(cluster: Cluster) -> dict[str, float]:
    """Every live gauge that is not 0, as "role pid: name"."""
    return {f"{service.role} {service.process.pid}: {name}": value for service in cluster.services
            for name, value in scrape(service.metrics).items() if name in LIVE and value}


def _failovers(gateway: Service) -> dict[str, int]:
    samples = scrape(gateway.metrics)
    return {"retries": int(samples["pdserve_retries_total"]), "migrations": int(samples["pdserve_migrations_total"])}


def _live(cluster: Cluster) -> float:
    return sum(_held(cluster).values())


def _drained_within(cluster: Cluster, limit_s: float) -> float | None:
    """Seconds until every live gauge is 0, or None if not within `limit_s`."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if _live(cluster) == 0:
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(tokens)]


async def _stream(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest,
                  deadline_s: float, on_first: Callable[[], None] | None = None) -> tuple[list[int], str, float]:
    """(token ids, final status name, seconds to the first token or to the failure); `on_first()` runs when
    the first token arrives."""
    tokens: list[int] = []
    started = time.perf_counter()
    first = 0.0
    try:
        async for response in stub.Generate(request, timeout=deadline_s):
            if not first and on_first is not None:
                on_first()
            first = first or time.perf_counter() - started
            tokens += response.token_ids
        return tokens, "OK", first
    except grpc.aio.AioRpcError as exc:
        return tokens, exc.code().name, first or time.perf_counter() - started


def _greedy(prompt: list[int], max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _read_or_cancel(call: Any, cancel_after: float | None) -> tuple[BaseException | None, int, bool]:
    """Read `call` to its end, or cancel it after `cancel_after` seconds: (how it ended, None if OK; tokens
    received; whether it was cancelled here)."""
    received = 0

    async def read() -> None:
        nonlocal received
        async for response in call:
            received += len(response.token_ids)

    reading = asyncio.ensure_future(read())
    await asyncio.wait([reading], timeout=cancel_after)
    cancelled = not reading.done()
    if cancelled:
        call.cancel()
    ended = (await asyncio.gather(reading, return_exceptions=True))[0]
    return ended, received, cancelled


def cancel_storm(model: str, args: argparse.Namespace) -> dict[str, Any]:
    cluster = _cluster(model)
    rng = random.Random(0)
    try:
        async def storm() -> tuple[dict[str, int], float]:
            outcomes = {"cancelled_before_first_token": 0, "cancelled_mid_stream": 0, "finished_first": 0}
            last_cancel = 0.0
            limit = asyncio.Semaphore(32)
            async with grpc.aio.insecure_channel(cluster.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)

                async def one(index: int) -> None:
                    nonlocal last_cancel
                    async with limit:
                        call = stub.Generate(_greedy(_prompt(rng, rng.randrange(8, 300)), 64), timeout=120)
                        _, received, cancelled = await _read_or_cancel(call, rng.uniform(0, 1.5))
                        if not cancelled:
                            outcomes["finished_first"] += 1
                            return
                        last_cancel = time.monotonic()
                        outcomes["cancelled_mid_stream" if received else "cancelled_before_first_token"] += 1

                await asyncio.gather(*(one(i) for i in range(args.cancels)))
            return outcomes, last_cancel

        outcomes, last_cancel = asyncio.run(storm())
        held = _held(cluster)
        waited = _drained_within(cluster, 5.0)
        # seconds from the last cancel until every gauge read 0 (the storm's own wind-down included)
        drained = None if waited is None else time.monotonic() - last_cancel
        after = asyncio.run(_after(cluster.gateway.address))
        return {"requests": args.cancels, **outcomes, "drained_after_last_cancel_s": drained,
                "held_when_checked": held, "held_after_5_s": {} if waited is not None else _held(cluster),
                "normal_request_after": after,
                "ok": drained is not None and drained <= 1.0 and after == "OK"}
    finally:
        cluster.stop()


_WORDS = ("river", "stone", "quiet", "market", "lantern", "orbit", "meadow", "copper", "signal", "harbor", "winter",
          "garden", "thunder", "paper", "violet", "engine", "canyon", "mirror", "falcon", "silver")


def storm(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Open-loop arrivals: `--storm` requests evenly over 4 s, each a unique text prompt of 20-900 words and 64
    tokens to generate; half are read to the end, half cancelled after a random 0-3 s."""
    max_words = min(900, (model_context(Path(model)) - 64) // 2)  # a word is a token or two; 64 generated
    cluster = _cluster(model)
    rng = random.Random(1)
    try:
        async def run_storm() -> tuple[dict[str, int], list[str], float]:
            outcomes: dict[str, int] = {}
            unexpected: list[str] = []
            last_end = 0.0
            async with grpc.aio.insecure_channel(cluster.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)

                async def one(index: int, words: int, cancel_after: float | None) -> None:
                    nonlocal last_end
                    await asyncio.sleep(index * 4.0 / args.storm)
                    text = f"{index} " + " ".join(rng.choice(_WORDS) for _ in range(words))
                    call = stub.Generate(gateway_pb2.GenerateRequest(prompt=text, max_tokens=64, ignore_eos=True),
                                         timeout=300)
                    error, received, _ = await _read_or_cancel(call, cancel_after)
                    last_end = time.monotonic()
                    if error is None:
                        outcome = "finished"
                    elif isinstance(error, asyncio.CancelledError) and cancel_after is not None:
                        outcome = "cancelled_mid_stream" if received else "cancelled_before_first_token"
                    elif isinstance(error, grpc.aio.AioRpcError) and not received \
                            and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        outcome = "refused_before_start"
                    else:
                        outcome = "unexpected"
                        unexpected.append(f"{type(error).__name__}: {getattr(error, 'code', lambda: '')()} "
                                          f"{getattr(error, 'details', lambda: str(error))()}"[:200])
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

                plan = [(i, rng.randint(min(20, max_words), max_words),
                         rng.uniform(0, 3) if rng.random() < 0.5 else None) for i in range(args.storm)]
                await asyncio.gather(*(one(*p) for p in plan))
            return outcomes, unexpected, last_end

        outcomes, unexpected, last_end = asyncio.run(run_storm())
        waited = _drained_within(cluster, 5.0)
        drained = None if waited is None else time.monotonic() - last_end  # the last end to every gauge at 0
        return {"requests": args.storm, **outcomes, "unexpected_statuses": unexpected[:10],
                "drained_after_last_end_s": drained, "held_after_5_s": {} if waited is not None else _held(cluster),
                "ok": not unexpected and drained is not None and drained <= 1.0}
    finally:
        cluster.stop()


async def _after(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        _, status, _ = await _stream(gateway_pb2_grpc.GatewayStub(channel), _greedy([1, 2, 3, 4], 4), 60)
    return status


async def _streams(
    address: str, requests: list[gateway_pb2.GenerateRequest], deadline_s: float,
    during: Callable[[], None] | None = None, after_s: float = 0.0, every_s: float = 0.0,
    once_streaming: int = 0,
) -> list[tuple[list[int], str, float]]:
    """Run `requests`, one every `every_s` (0: all at once). `during()` runs (in a thread, off the event loop)
    `after_s` seconds in, or once `once_streaming` streams have received a token."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        streaming = 0
        enough = asyncio.Event()

        def first_token() -> None:
            nonlocal streaming
            streaming += 1
            if streaming >= once_streaming:
                enough.set()

        async def arrive(index: int, request: gateway_pb2.GenerateRequest) -> tuple[list[int], str, float]:
            await asyncio.sleep(index * every_s)
            return await _stream(stub, request, deadline_s, first_token)

        runs = asyncio.gather(*(arrive(i, request) for i, request in enumerate(requests)))
        if during is not None:
            await asyncio.sleep(after_s)
            if once_streaming:
                waiting: list[asyncio.Future[Any]] = [runs, asyncio.ensure_future(enough.wait())]
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.to_thread(during)
        return list(await runs)


def kill_decode(model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1)
    requests = [_greedy(_prompt(rng, rng.randrange(16, 200)), args.max_tokens) for _ in range(args.streams)]
    cluster = _cluster(model)
    try:
        expected = asyncio.run(_streams(cluster.gateway.address, requests, 300))
        victim = cluster.decode[0]

        def kill() -> None:
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait(timeout=10)

        # killed once half the streams are under way, so some migrate mid-stream and others retry
        got = asyncio.run(_streams(cluster.gateway.address, requests, 300, kill, once_streaming=len(requests) // 2))
        cluster.decode.remove(victim)
        identical = sum(g[0] == e[0] and g[1] == "OK" for g, e in zip(got, expected))
        completed = sum(g[1] == "OK" for g in got)
        drained = _drained_within(cluster, 5.0)
        return {"streams": len(requests), "completed": completed, "identical": identical,
                "reference_ok": sum(e[1] == "OK" for e in expected), **_failovers(cluster.gateway),
                "drained_s": drained,
                "ok": identical == len(requests) and drained is not None}
    finally:
        cluster.stop()


def kill_prefill(model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(2)
    requests = [_greedy(_prompt(rng, rng.randrange(64, 400)), 8) for _ in range(args.streams)]
    cluster = _cluster(model)
    try:
        victim = cluster.prefill[0]

        def kill() -> None:
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait(timeout=10)

        got = asyncio.run(_streams(cluster.gateway.address, requests, 300, kill, after_s=0.5))
        cluster.prefill.remove(victim)
        completed = sum(status == "OK" and len(tokens) == 8 for tokens, status, _ in got)
        drained = _drained_within(cluster, 5.0)
        return {"requests": len(requests), "completed": completed, **_failovers(cluster.gateway), "drained_s": drained,
                "ok": completed == len(requests) and drained is not None}
    finally:
        cluster.stop()


def link_fault(model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(3)
    deadline_s = 30.0
    requests = [_greedy(_prompt(rng, rng.randrange(16, 128)), args.max_tokens) for _ in range(args.streams)]
    cluster = _cluster(model, decode_args=("--lease=10",))
    proxies = [FaultProxy(service.address) for service in cluster.decode]
    # a second gateway that reaches the decode workers (and sends prefill to them) through the proxies
    gateway = spawn_service("gateway", "gateway", ["--host", "127.0.0.1", "--port", "0", "--model", model,
                                                   *(f"--prefill={s.address}" for s in cluster.prefill),
                                                   *(f"--decode={p.address}" for p in proxies)])
    try:
        wait_ready([gateway], 120)
        wait_healthy(gateway.address, 60)
        proxies[0].at([(0.8, proxies[0].reset)])
        proxies[1].at([(1.2, proxies[1].blackhole), (3.2, proxies[1].restore)])
        started = time.monotonic()
        got = asyncio.run(_streams(gateway.address, requests, deadline_s))
        elapsed = time.monotonic() - started
        statuses: dict[str, int] = {}
        for _, status, _ in got:
            statuses[status] = statuses.get(status, 0) + 1
        clear = all(status == "OK" or status in CLEAR_STATUSES for _, status, _ in got)
        drained = _drained_within(cluster, 10.0)
        return {"requests": len(requests), "statuses": statuses, **_failovers(gateway), "elapsed_s": elapsed,
                "deadline_s": deadline_s, "drained_s": drained,
                "ok": clear and elapsed < deadline_s + 1 and drained is not None}
    finally:
        stop_all([gateway], grace_s=5)
        for proxy in proxies:
            proxy.close()
        cluster.stop()


def overload(model: str, args: argparse.Namespace) -> dict[str, Any]:
    running, queued = 4, 4
    # The arrivals stand for many clients behind one address, refused at once each time: pausing the refusals of a
    # client that retries too fast (--instant-refusals-per-client) is `bench abuse`'s subject, not this one's.
    cluster = _cluster(model, prefill=1, decode=1, gateway_args=(
        f"--max-in-flight={running}", f"--max-queue={queued}", "--queue-timeout=30",
        "--instant-refusals-per-client=0"))
    rng = random.Random(4)
    try:
        def rss_mb() -> float:
            status = Path(f"/proc/{cluster.gateway.process.pid}/status").read_text()
            return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024

        # capacity: requests per second the cluster serves with every place taken
        started = time.perf_counter()
        baseline = asyncio.run(_streams(cluster.gateway.address,
                                        [_greedy(_prompt(rng, 64), 8) for _ in range(running)], 120))
        capacity = running / (time.perf_counter() - started)
        before = rss_mb()
        every = 1 / (10 * capacity)  # arrivals at 10x that rate, for 3 s (at most 400 requests)
        flood = [_greedy(_prompt(rng, 64), 8) for _ in range(max(4 * (running + queued), min(400, int(3 / every))))]
        got = asyncio.run(_streams(cluster.gateway.address, flood, 120, every_s=every))
        growth = rss_mb() - before
        refused = [seconds for _, status, seconds in got if status == "RESOURCE_EXHAUSTED"]
        admitted = sorted(seconds for _, status, seconds in got if status == "OK")
        base_ttft = percentile([seconds for _, _, seconds in baseline], 50)
        first_admitted = percentile(admitted[:running], 50) if admitted else float("inf")
        refusal_p99 = percentile(refused, 99) if refused else 0.0
        return {"capacity_rps": capacity, "arrival_rps": 1 / every, "sent": len(flood), "admitted": len(admitted),
                "refused": len(refused), "other": len(flood) - len(admitted) - len(refused),
                "refusal_p99_s": refusal_p99, "baseline_ttft_p50_s": base_ttft,
                "first_admitted_ttft_p50_s": first_admitted, "gateway_rss_growth_mb": growth,
                "ok": bool(refused) and refusal_p99 < 0.05 and first_admitted <= 2 * base_ttft and growth < 50
                and len(admitted) + len(refused) == len(flood)}
    finally:
        cluster.stop()


EXPERIMENTS: dict[str, Callable[[str, argparse.Namespace], dict[str, Any]]] = {
    "cancel_storm": cancel_storm, "storm": storm, "kill_decode": kill_decode, "kill_prefill": kill_prefill,
    "link_fault": link_fault, "overload": overload,
}


def _table(results: dict[str, Any]) -> str:
    lines = []
    for name, result in results.items():
        detail = ", ".join(f"{key}={_short(value)}" for key, value in result.items() if key != "ok")
        lines.append(f"{name:<13} {'ok' if result['ok'] else 'FAILED':<7} {detail}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
