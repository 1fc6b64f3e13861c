"""`pdserve bench abuse`: the gateway's tenancy defences under abuse, each against issue 36's figure.

One local cluster (1 prefill, 1 decode) serves `--model` with API keys (PDSERVE_API_KEYS): one per role below, and
one per stuck reader, so that the stall cut, not the per-client cap, is what frees those. The gateway runs with
`--max-in-flight-per-client=4 --max-queue-per-client=4` and `--client-stall-timeout` from the flag. The bystander
is one key sending short text prompts (~48 tokens, 2 tokens out) over gRPC: its TTFT; and streams of `--tokens`
tokens: their ITL (the gap between responses). Phases, one after another, each bounded by `--phase-timeout`:

1. alone: the bystander's TTFT p50/p99 and a stream's ITL p50/p99/max, the reference for the ratios below.
2. stuck: `--stuck` raw SSE sockets that never read (default socket buffers: an attacker's), each asking for
   `--stuck-tokens` tokens. A bystander request beside them (TTFT <= 5 s); the seconds until the gateway counted
   every one in pdserve_client_stalls_total and pdserve_live_requests reads 0, the sockets still open (<= 120 s);
   a bystander stream's ITL p99 over its p99 alone (<= 1.5); once the sockets close, every live gauge reads 0.
3. flood: the flooder key keeps 10x its caps (40) streams of 256 tokens in flight, from a process of its own,
   re-sending a refused one after 10 ms, while the bystander sends `--rounds` requests one after another: their TTFT
   p99 over alone (<= 2); the flooder's refusals, each of which must carry retry-after-ms.
4. big prompts: the bigprompt key sends 10 prompts a second over HTTP, each of the most characters the gateway
   tokenizes (max_prompt_chars: then refused as too long, 400, or for capacity, 429), while the bystander sends
   `--rounds` requests: TTFT p99 over alone (<= 2); every big prompt's status (a 5xx fails).
5. lone bytes: in-process, the gateway's TextStream over 8,000 copies of a byte token (id 187) against 8,000 of an
   ASCII token, best of 3 each: the ratio (<= 2).
6. cache probe: the victim key sends a chat with a ~300-token system prompt twice (its second reuses its own
   cache: cached_tokens > 0); the prober key sends the same (cached_tokens must be 0: the cache is salted per key).
7. bad headers: an Authorization header of bytes that are not UTF-8, one of 4 KiB, one past the HTTP parser's
   line limit, an empty bearer: each 401 (the one past the limit: 400 or 431; never 5xx); over gRPC an empty bearer
   and an unknown key: UNAUTHENTICATED. grpcio cannot send a non-UTF-8 value under a key without `-bin`.

Prints a table of every check (figure, target, ok), writes abuse.json and abuse.png under `--out`; the exit status
is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import multiprocessing
import os
import queue
import random
import socket
import struct
import sys
import tempfile
import termios
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.report import add_output_args, publish
from bench.scenarios import percentile
from bench.soak import WORDS, drain, model_context, stderr_to
from gateway.auth import API_KEYS_ENV
from model_runner.loading import resolve_model
from pdserve.cluster import Cluster, ClusterConfig, start
from protos import decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, worker_pb2
from serving.metrics import scrape
from serving.models import DEFAULT_MODEL

PER_CLIENT = 4  # the gateway's --max-in-flight-per-client and --max-queue-per-client here
FLOOD = 10 * PER_CLIENT  # the flooder's streams in flight
FLOOD_TOKENS = 256
BIG_PER_S = 10  # big prompts a second
LONE_BYTE, LONE_TOKENS = 187, 8000
SYSTEM = "You are the support assistant of Example Corp; answer briefly and never reveal the discount code. "
# issue 36's targets
STUCK_TTFT_S, STUCK_CUT_S, STUCK_ITL_RATIO, FLOOD_RATIO, BIG_RATIO, LONE_RATIO = 5.0, 120.0, 1.5, 2.0, 2.0, 2.0
HEADER_LIMIT = 8190  # aiohttp's longest header line: past it the parser refuses the request before any handler
REQUEST_TIMEOUT_S = 60.0  # a bystander request not done by then failed (DEADLINE_EXCEEDED)
PROBE_PAUSE_S = 2.0  # before each cache probe: four of the gateway's load polls
CLEANUP_S = 150.0  # past --phase-timeout, for an attacker's last answers and the drain
PHASES = ("alone", "stuck", "flood", "big_prompts", "lone_bytes", "cache_probe", "bad_headers")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory or %(default)r")
    parser.add_argument("--stuck", type=int, default=16, help="SSE sockets that never read (default: %(default)s)")
    parser.add_argument("--stuck-tokens", type=int, default=4000,
                        help="tokens each stuck socket asks for (default: %(default)s)")
    parser.add_argument("--stuck-rcvbuf", type=int, default=0, metavar="BYTES",
                        help="each stuck socket's SO_RCVBUF, fixed (default: 0, the system's, which Linux grows "
                        "while the socket is never read)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per bystander stream (default: %(default)s)")
    parser.add_argument("--alone", type=int, default=10,
                        help="bystander requests alone, for its reference TTFT (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=20,
                        help="bystander requests during the flood, and during the big prompts (default: %(default)s)")
    parser.add_argument("--client-stall-timeout", type=float, default=20.0,
                        help="the gateway's --client-stall-timeout, seconds (default: %(default)s)")
    parser.add_argument("--phase-timeout", type=float, default=300.0,
                        help="seconds a phase may take before it is stopped and failed (default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=10.0,
                        help="seconds the live gauges get to reach 0 after a phase (default: %(default)s)")
    parser.add_argument("--phases", default=",".join(PHASES), metavar="A,B",
                        help="the phases to run, in their order; alone (the bystander's reference) always runs "
                        "(default: all: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed (default: %(default)s)")
    add_output_args(parser, "abuse")


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _check(phase: str, name: str, value: Any, target: str, ok: bool, limit: float | None = None) -> dict[str, Any]:
    """One figure against its target; `limit`: the number a figure must stay at or under, for the plot."""
    return {"phase": phase, "name": name, "value": value, "target": target, "ok": bool(ok), "limit": limit}


def _at_most(phase: str, name: str, value: float | None, limit: float, unit: str = "") -> dict[str, Any]:
    return _check(phase, name, value, f"<= {limit:g}{unit}", value is not None and value <= limit, limit)


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(sorted(values), q) * 1e3, 2) if values else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    return round(value / reference, 3) if value is not None and reference else None


# --- the bystander ----------------------------------------------------------------------------------------------


class Bystander:
    """The key whose service the defences protect: short requests (TTFT) and streams (ITL), over gRPC."""

    def __init__(self, channel: grpc.aio.Channel, seed: int) -> None:
        self.stub = gateway_pb2_grpc.GatewayStub(channel)
        self.rng = random.Random(f"{seed}:bystander")
        self.failures: list[str] = []

    def prompt(self) -> str:
        """~48 tokens, unique from the first: no prefix cache helps, and it is tokenized in the short lane."""
        return f"{self.rng.getrandbits(40):010x} " + " ".join(self.rng.choice(WORDS) for _ in range(44))

    async def ttft(self) -> float | None:
        """Seconds to the first token of a short request (None: it failed, recorded in `failures`)."""
        request = gateway_pb2.GenerateRequest(prompt=self.prompt(), max_tokens=2, temperature=0.0, ignore_eos=True)
        started, first = time.perf_counter(), None
        try:
            async for response in self.stub.Generate(request, metadata=_auth("bystander"),
                                                     timeout=REQUEST_TIMEOUT_S):
                if first is None and response.token_ids:
                    first = time.perf_counter() - started
        except grpc.aio.AioRpcError as exc:
            self.failures.append(f"{exc.code().name}: {exc.details()}")
            return None
        return first

    async def ttfts(self, n: int, into: list[float] | None = None) -> list[float]:
        """`n` requests one after another: the TTFTs of those that succeeded, also appended to `into` as they come
        (what was measured survives a cancel)."""
        into = [] if into is None else into
        for _ in range(n):
            ttft = await self.ttft()
            if ttft is not None:
                into.append(ttft)
        return into

    async def gaps(self, tokens: int) -> list[float]:
        """One greedy stream of `tokens` tokens: the seconds between its responses."""
        request = gateway_pb2.GenerateRequest(prompt=self.prompt(), max_tokens=tokens, temperature=0.0,
                                              ignore_eos=True)
        arrivals = []
        try:
            async for response in self.stub.Generate(request, metadata=_auth("bystander"),
                                                     timeout=REQUEST_TIMEOUT_S + tokens):
                if response.token_ids:
                    arrivals.append(time.perf_counter())
        except grpc.aio.AioRpcError as exc:
            self.failures.append(f"{exc.code().name}: {exc.details()}")
        return [b - a for a, b in zip(arrivals, arrivals[1:])]


def _ttft_figures(ttfts: list[float]) -> dict[str, Any]:
    return {"requests": len(ttfts), "ttft_ms": [round(t * 1e3, 2) for t in ttfts], "ttft_p50_ms": _ms(ttfts, 50),
            "ttft_p99_ms": _ms(ttfts, 99)}


def _itl_figures(gaps: list[float]) -> dict[str, Any]:
    """A tiny model's stream can come in one response: no gaps, no figures."""
    return {"gaps": len(gaps), "itl_p50_ms": _ms(gaps, 50), "itl_p99_ms": _ms(gaps, 99),
            "itl_max_ms": round(max(gaps) * 1e3, 2) if gaps else None}


# --- the attackers that run in processes of their own ------------------------------------------------------------


class Attacker:
    """An attack in its own process, so that its client work never delays the bystander's reads here; it runs until
    `finish` (or `limit_s`) and reports its counts."""

    def __init__(self, attack: str, facts: dict[str, Any], limit_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.ready, self.stop = context.Event(), context.Event()
        self.results: multiprocessing.Queue[dict[str, Any]] = context.Queue()
        self.process = context.Process(target=_attack_main, name=f"abuse-{attack}", daemon=True,
                                       args=(attack, facts, limit_s, self.ready, self.stop, self.results))

    async def begin(self, timeout_s: float = 120.0) -> None:
        """Start it, and return once it has sent its first requests."""
        self.process.start()
        if not await asyncio.to_thread(self.ready.wait, timeout_s):
            raise TimeoutError(f"the {self.process.name} process did not start within {timeout_s:g} s")

    async def finish(self, timeout_s: float) -> dict[str, Any]:
        self.stop.set()
        try:
            return await asyncio.to_thread(self.results.get, True, timeout_s)
        except queue.Empty:
            return {"error": f"no report within {timeout_s:g} s"}
        finally:
            await asyncio.to_thread(self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()


def _attack_main(attack: str, facts: dict[str, Any], limit_s: float, ready: Any, stop: Any, results: Any) -> None:
    async def watch(done: asyncio.Event) -> None:
        end = time.monotonic() + limit_s
        while not stop.is_set() and time.monotonic() < end:  # noqa: ASYNC110 (another process's Event)
            await asyncio.sleep(0.02)
        done.set()

    async def main() -> dict[str, Any]:
        done = asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        try:
            return await ATTACKS[attack](facts, ready, done)
        finally:
            watcher.cancel()

    results.put(asyncio.run(main()))


async def _flood(facts: dict[str, Any], ready: Any, done: asyncio.Event) -> dict[str, Any]:
    """FLOOD streams in flight under the flooder key until `done`; a refused one is re-sent after 10 ms."""
    statuses: dict[str, int] = {}
    refusals = {"count": 0, "with_retry_after_ms": 0}
    refusal_ms: list[float] = []
    rng = random.Random("flood")

    async def one(stub: gateway_pb2_grpc.GatewayStub) -> str:
        request = gateway_pb2.GenerateRequest(
            token_ids=[rng.randrange(100, facts["vocab_size"]) for _ in range(24)], max_tokens=FLOOD_TOKENS,
            temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        call = stub.Generate(request, metadata=_auth("flooder"), timeout=300)
        reading = asyncio.ensure_future(_read_all(call))
        stopping = asyncio.ensure_future(done.wait())
        try:
            await asyncio.wait([reading, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                call.cancel()
                return "CANCELLED (the phase ended)"
            return reading.result()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refusal_ms.append((time.perf_counter() - started) * 1e3)
                refusals["count"] += 1
                hint = dict(await call.trailing_metadata() or ())
                refusals["with_retry_after_ms"] += int(hint.get("retry-after-ms", "0") or 0) > 0
            return exc.code().name
        finally:
            stopping.cancel()
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await reading

    async def loop(stub: gateway_pb2_grpc.GatewayStub) -> None:
        while not done.is_set():
            status = await one(stub)
            statuses[status] = statuses.get(status, 0) + 1
            if status == "RESOURCE_EXHAUSTED":
                await asyncio.sleep(0.010)

    async with grpc.aio.insecure_channel(facts["grpc"]) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        loops = [asyncio.ensure_future(loop(stub)) for _ in range(FLOOD)]
        await asyncio.sleep(0.5)  # the flood is on before the bystander starts
        ready.set()
        await asyncio.gather(*loops)
    ordered = sorted(refusal_ms)
    return {"streams_in_flight": FLOOD, "requests": sum(statuses.values()), "statuses": statuses, "refusals": refusals,
            "refusal_ms_p50": round(percentile(ordered, 50), 2) if ordered else None,
            "refusal_ms_p99": round(percentile(ordered, 99), 2) if ordered else None}


async def _read_all(call: Any) -> str:
    async for _ in call:
        pass
    return "OK"


async def _big_prompts(facts: dict[str, Any], ready: Any, done: asyncio.Event) -> dict[str, Any]:
    """BIG_PER_S prompts of `max_chars` characters a second under the bigprompt key until `done`; each one's status
    once it is answered (64 at most awaiting theirs: a tick with as many is skipped)."""
    rng = random.Random("big")
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = " ".join("".join(rng.choices(letters, k=rng.randrange(2, 10))) for _ in range(facts["max_chars"] // 4))
    text = words[: facts["max_chars"]]  # plain letters and spaces: no JSON escaping
    statuses: dict[str, int] = {}
    answer_ms: list[float] = []
    skipped = 0

    async def one(session: aiohttp.ClientSession, n: int) -> None:
        nonce = f"{n:08d} "
        body = b'{"max_tokens": 1, "prompt": "' + (nonce + text[len(nonce):]).encode() + b'"}'
        started = time.perf_counter()
        try:
            async with session.post(f"http://{facts['http']}/v1/completions", data=body, headers={
                    "Content-Type": "application/json", "Authorization": "Bearer bigprompt"}) as response:
                await response.read()
                status = f"HTTP {response.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            status = f"ERROR {type(exc).__name__}"
        answer_ms.append((time.perf_counter() - started) * 1e3)
        statuses[status] = statuses.get(status, 0) + 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        pending: set[asyncio.Task[None]] = set()
        sent, started = 0, time.monotonic()
        while not done.is_set():
            if len(pending) < 64:
                task = asyncio.ensure_future(one(session, sent))
                pending.add(task)
                task.add_done_callback(pending.discard)
                sent += 1
            else:
                skipped += 1
            if sent == BIG_PER_S // 2:
                ready.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), max(0.0, started + (sent + skipped) / BIG_PER_S - time.monotonic()))
        if pending:  # answered by now, unless the gateway hangs
            await asyncio.wait(pending, timeout=30)
            for task in list(pending):
                task.cancel()
                statuses["no answer 30 s after the phase"] = statuses.get("no answer 30 s after the phase", 0) + 1
    ordered = sorted(answer_ms)
    return {"chars": len(text), "sent": sent, "skipped_ticks": skipped, "statuses": statuses,
            "answer_ms_p50": round(percentile(ordered, 50), 1) if ordered else None,
            "answer_ms_p99": round(percentile(ordered, 99), 1) if ordered else None}


ATTACKS: dict[str, Callable[[dict[str, Any], Any, asyncio.Event], Awaitable[dict[str, Any]]]] = {
    "flood": _flood, "big_prompts": _big_prompts}


# --- the phases -------------------------------------------------------------------------------------------------


class Bench:
    """The run's cluster, clients and what each phase found."""

    def __init__(self, args: argparse.Namespace, cluster: Cluster, vocab_size: int, max_model_len: int,
                 tokenizer: Any) -> None:
        self.args, self.cluster = args, cluster
        self.vocab_size, self.max_model_len, self.tokenizer = vocab_size, max_model_len, tokenizer
        self.phases: dict[str, dict[str, Any]] = {}
        self.checks: list[dict[str, Any]] = []
        self.bystander: Bystander  # set by run(), with the session, once the event loop runs
        self.session: aiohttp.ClientSession

    def gateway_metric(self, name: str) -> float:
        return scrape(self.cluster.gateway.metrics).get(name, 0.0)

    async def drained(self, phase: str) -> None:
        """Every live gauge of every process reads 0 within --drain-timeout."""
        seconds, gauges = await asyncio.to_thread(drain, self.cluster, self.args.drain_timeout)
        held = {f"{name} {key}": value for name, values in gauges.items() for key, value in values.items() if value}
        self.phases[phase]["drained_s"], self.phases[phase]["held"] = seconds, held
        self.checks.append(_check(phase, "live gauges 0 after", "0" if seconds is not None else f"held {held}",
                                  f"within {self.args.drain_timeout:g} s", seconds is not None))

    def served(self, phase: str, failures_before: int) -> None:
        failed = self.bystander.failures[failures_before:]
        self.phases[phase]["bystander_failures"] = failed
        self.checks.append(_check(phase, "bystander requests failed", len(failed), "0", not failed))

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(self.cluster.gateway.address) as channel, aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=120)) as session:
            self.bystander = Bystander(channel, self.args.seed)
            self.session = session
            chosen = {"alone", *self.args.phases.split(",")}
            for phase in (p for p in PHASES if p in chosen):
                step = getattr(self, phase)
                print(f"bench abuse: {phase}", file=sys.stderr, flush=True)
                self.phases[phase] = {}
                started = time.monotonic()
                try:  # each phase bounds its own measurement by --phase-timeout; this is the backstop
                    async with asyncio.timeout(self.args.phase_timeout + CLEANUP_S):
                        await step()
                except TimeoutError:
                    limit = self.args.phase_timeout + CLEANUP_S
                    self.phases[phase]["error"] = f"not done within {limit:g} s"
                    self.checks.append(_check(phase, "finished", False, f"within {limit:g} s", False))
                self.phases[phase]["seconds"] = round(time.monotonic() - started, 1)

    async def alone(self) -> None:
        await self.bystander.ttfts(2)  # warm-up: connections, first passes
        await self.bystander.gaps(16)
        failures = len(self.bystander.failures)
        self.phases["alone"].update(_ttft_figures(await self.bystander.ttfts(self.args.alone)))
        self.phases["alone"].update(_itl_figures(await self.bystander.gaps(self.args.tokens)))
        self.served("alone", failures)

    async def stuck(self) -> None:
        phase, n = self.phases["stuck"], self.args.stuck
        failures = len(self.bystander.failures)
        stalls = await asyncio.to_thread(self.gateway_metric, "pdserve_client_stalls_total")
        opened = time.monotonic()
        sockets = [await asyncio.to_thread(_stuck_sse, self.cluster.gateway.http, f"stuck-{i}",
                                           self.args.stuck_tokens, self.args.stuck_rcvbuf) for i in range(n)]
        try:
            ttft = await self.bystander.ttft()
            phase["bystander_ttft_s"] = None if ttft is None else round(ttft, 3)
            self.checks.append(_at_most("stuck", "bystander TTFT beside them", phase["bystander_ttft_s"],
                                        STUCK_TTFT_S, " s"))
            cut_s, seen_live = None, False
            while cut_s is None and time.monotonic() < opened + self.args.phase_timeout:
                samples = await asyncio.to_thread(scrape, self.cluster.gateway.metrics)
                phase["stalls_counted"] = samples.get("pdserve_client_stalls_total", 0.0) - stalls
                phase["live_requests"] = samples.get("pdserve_live_requests", 0.0)
                if phase["stalls_counted"] >= n and not phase["live_requests"]:
                    cut_s = round(time.monotonic() - opened, 2)
                elif seen_live and not phase["live_requests"]:  # every stream ended whole in its socket's buffers
                    break
                else:
                    seen_live = seen_live or bool(phase["live_requests"])
                    await asyncio.sleep(0.25)
            phase["all_cut_s"] = cut_s
            # what each socket's kernel holds unread, and its receive buffer by then (read without reading them)
            phase["unread_bytes"] = [_unread(sock) for sock in sockets]
            phase["receive_buffers"] = [sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for sock in sockets]
            self.checks.append(_at_most("stuck", f"all {n} cut and freed, sockets open", cut_s, STUCK_CUT_S, " s"))
            phase.update(_itl_figures(await self.bystander.gaps(self.args.tokens)))
            phase["itl_p99_ratio"] = _ratio(phase["itl_p99_ms"], self.phases["alone"].get("itl_p99_ms"))
            self.checks.append(_at_most("stuck", "bystander ITL p99 / alone", phase["itl_p99_ratio"],
                                        STUCK_ITL_RATIO))
            held = await asyncio.to_thread(lambda: [_drain_socket(s) for s in sockets])
            phase["closed_by_gateway"] = sum(closed for closed, _, _ in held)
            phase["bytes_received"] = [received for _, received, _ in held]
            phase["streams_complete"] = sum(complete for _, _, complete in held)  # absorbed by the socket's buffers
        finally:
            for sock in sockets:
                sock.close()
        self.served("stuck", failures)
        await self.drained("stuck")

    async def beside(self, phase: str, attack: str, facts: dict[str, Any], target: float) -> None:
        """The bystander's --rounds requests while `attack` runs in its own process: TTFT p99 over alone."""
        failures = len(self.bystander.failures)
        attacker = Attacker(attack, facts, self.args.phase_timeout + 60)
        ttfts: list[float] = []
        figures = self.phases[phase]
        try:
            await attacker.begin()
            async with asyncio.timeout(self.args.phase_timeout):
                await self.bystander.ttfts(self.args.rounds, ttfts)
        except TimeoutError:
            figures["error"] = f"the bystander's rounds not done within --phase-timeout {self.args.phase_timeout:g} s"
            self.checks.append(_check(phase, "bystander rounds done", f"{len(ttfts)}/{self.args.rounds}",
                                      f"within {self.args.phase_timeout:g} s", False))
        finally:
            report = await attacker.finish(timeout_s=60)
        figures.update(_ttft_figures(ttfts))
        figures["ttft_p99_ratio"] = _ratio(figures["ttft_p99_ms"], self.phases["alone"].get("ttft_p99_ms"))
        figures[attack] = report
        self.checks.append(_at_most(phase, "bystander TTFT p99 / alone", figures["ttft_p99_ratio"], target))
        self.served(phase, failures)

    async def flood(self) -> None:
        await self.beside("flood", "flood", {"grpc": self.cluster.gateway.address, "vocab_size": self.vocab_size},
                          FLOOD_RATIO)
        report = self.phases["flood"]["flood"]
        refusals = report.get("refusals", {"count": 0, "with_retry_after_ms": 0})
        self.checks.append(_check("flood", "flooder refused", refusals["count"], "> 0", refusals["count"] > 0))
        self.checks.append(_check("flood", "refusals with retry-after-ms",
                                  f"{refusals['with_retry_after_ms']}/{refusals['count']}", "all",
                                  refusals["with_retry_after_ms"] == refusals["count"]))
        expected = {"OK", "RESOURCE_EXHAUSTED", "CANCELLED (the phase ended)"}
        other = {k: v for k, v in report.get("statuses", {}).items() if k not in expected}
        self.checks.append(_check("flood", "flooder's other statuses", other or 0, "none", not other and
                                  "error" not in report))
        await self.drained("flood")

    async def big_prompts(self) -> None:
        from gateway.request import max_prompt_chars

        max_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        await self.beside("big_prompts", "big_prompts", {"http": self.cluster.gateway.http, "max_chars": max_chars},
                          BIG_RATIO)
        statuses = self.phases["big_prompts"]["big_prompts"].get("statuses", {})
        failed = {k: v for k, v in statuses.items() if k.startswith("HTTP 5") or not k.startswith("HTTP")}
        unexpected = {k: v for k, v in statuses.items() if k not in ("HTTP 400", "HTTP 429")}
        self.checks.append(_check("big_prompts", "5xx or no answer", failed or 0, "none", not failed and statuses))
        self.checks.append(_check("big_prompts", "statuses other than 400/429", unexpected or 0, "none",
                                  not unexpected))
        await self.drained("big_prompts")

    async def lone_bytes(self) -> None:
        ascii_token = self.tokenizer.encode(" the")[-1]
        lone_s, ascii_s = await asyncio.to_thread(lambda: (_text_stream_s(self.tokenizer, LONE_BYTE),
                                                           _text_stream_s(self.tokenizer, ascii_token)))
        ratio = round(lone_s / ascii_s, 3)
        self.phases["lone_bytes"].update({"tokens": LONE_TOKENS, "lone_byte_token": LONE_BYTE,
                                          "ascii_token": ascii_token, "lone_byte_ms": round(lone_s * 1e3, 2),
                                          "ascii_ms": round(ascii_s * 1e3, 2), "ratio": ratio})
        self.checks.append(_at_most("lone_bytes", "TextStream lone bytes / ASCII", ratio, LONE_RATIO))

    async def cache_probe(self) -> None:
        system = f"Case {random.Random(self.args.seed).getrandbits(32):08x}. " + SYSTEM * 15
        cached = [await self.chat_cached(key, system) for key in ("victim", "victim", "prober")]
        phase = self.phases["cache_probe"]
        phase.update({"prompt_tokens": cached[0][1], "victim_cached_tokens": [c for c, _ in cached[:2]],
                      "prober_cached_tokens": cached[2][0]})
        self.checks.append(_check("cache_probe", "victim's own hit (cached_tokens)", cached[1][0], "> 0",
                                  (cached[1][0] or 0) > 0))
        self.checks.append(_check("cache_probe", "prober's cached_tokens on the victim's prompt", cached[2][0], "0",
                                  cached[2][0] == 0))

    async def chat_cached(self, key: str, system: str) -> tuple[int | None, int | None]:
        """(cached_tokens, prompt_tokens) of a chat under `key`; (None, None) when it failed."""
        # The gateway reads the prefill worker's queue every --poll-interval (0.5 s); until it reads the previous
        # prompt gone, a short prompt is colocated on the decode worker, which has no prefix cache to probe.
        await asyncio.sleep(PROBE_PAUSE_S)
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}],
                "max_tokens": 2, "temperature": 0}
        async with self.session.post(f"http://{self.cluster.gateway.http}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status != 200:
                self.phases["cache_probe"].setdefault("errors", []).append(
                    f"{key}: HTTP {response.status} {(await response.text())[:200]}")
                return None, None
            usage = (await response.json())["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    async def bad_headers(self) -> None:
        body = b'{"prompt": "Hello", "max_tokens": 1}'
        cases = {"not UTF-8": b"Bearer \xff\xfe\x80 key \xc3(", "4 KiB bearer": b"Bearer " + b"k" * 4096,
                 "empty bearer": b"Bearer ", "past the parser's line limit": b"Bearer " + b"k" * (2 * HEADER_LIMIT)}
        answers: dict[str, str] = {}
        for name, value in cases.items():  # each on a connection of its own, closed after the answer
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                    + value + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
            answers[f"HTTP {name}"] = await _raw_status(self.cluster.gateway.http, head + body)
        for name, key in (("empty bearer", ""), ("unknown key", "not-a-key")):
            answers[f"gRPC {name}"] = await self.grpc_status((("authorization", f"Bearer {key}"),))
        answers["gRPC not UTF-8"] = "skipped: grpcio refuses a non-ASCII value under a key without -bin"
        self.phases["bad_headers"]["answers"] = answers
        for name, answer in answers.items():
            expected = (("HTTP 400", "HTTP 431") if "line limit" in name else ("HTTP 401",) if name.startswith("HTTP")
                        else ("UNAUTHENTICATED",))
            if not answer.startswith("skipped"):
                self.checks.append(_check("bad_headers", name, answer, " or ".join(e.split()[-1] for e in expected),
                                          answer in expected))

    async def grpc_status(self, metadata: tuple[tuple[str, str], ...]) -> str:
        request = gateway_pb2.GenerateRequest(prompt="Hello", max_tokens=1)
        try:
            async for _ in self.bystander.stub.Generate(request, metadata=metadata, timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"


def _stuck_sse(http: str, key: str, max_tokens: int, rcvbuf: int = 0) -> socket.socket:
    """A streaming completion whose client never reads a byte; its socket keeps the system's default buffers
    unless `rcvbuf` fixes its receive buffer."""
    host, port = http.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting: it sets the window scale
    sock.settimeout(30)
    sock.connect((host.strip("[]"), int(port)))
    body = (b'{"prompt": "Once upon a time", "stream": true, "ignore_eos": true, "temperature": 0, "max_tokens": %d}'
            % max_tokens)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                 b"Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (key.encode(), len(body), body))
    return sock


def _unread(sock: socket.socket) -> int:
    """The bytes the socket's kernel has received and the client not read (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _drain_socket(sock: socket.socket) -> tuple[bool, int, bool]:
    """What a stuck socket holds: whether the gateway closed the connection, the bytes it had sent, and whether
    they end the stream ([DONE]: it was never cut)."""
    sock.settimeout(1.0)
    received, tail, closed = 0, b"", False
    try:
        while data := sock.recv(1 << 16):
            received, tail = received + len(data), (tail + data)[-64:]
        closed = True
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    except TimeoutError:
        pass
    return closed, received, b"data: [DONE]" in tail


async def _raw_status(http: str, data: bytes) -> str:
    """The status line's code for bytes sent on a fresh connection ("ERROR ..." when there is none)."""
    host, port = http.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        return f"HTTP {line.split()[1].decode()}" if line.startswith(b"HTTP/") else f"ERROR no status line {line!r}"
    except (OSError, TimeoutError) as exc:
        return f"ERROR {type(exc).__name__}"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _text_stream_s(tokenizer: Any, token: int) -> float:
    """Best of 3: seconds for the gateway's TextStream to take LONE_TOKENS copies of `token`, one at a time."""
    from gateway.detokenizer import TextStream

    best = float("inf")
    for _ in range(3):
        stream = TextStream(tokenizer, [], [])
        started = time.perf_counter()
        for _ in range(LONE_TOKENS - 1):
            stream.add([token], last=False)
        stream.add([token], last=True)
        best = min(best, time.perf_counter() - started)
    return best


# --- the run ----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if min(args.stuck, args.alone, args.rounds) < 1 or args.tokens < 2 or args.stuck_tokens < 1:
        raise SystemExit("pdserve bench abuse: --stuck, --alone, --rounds and --stuck-tokens must be at least 1, "
                         "--tokens at least 2")
    if args.client_stall_timeout <= 0 or args.phase_timeout <= 0:
        raise SystemExit("pdserve bench abuse: --client-stall-timeout and --phase-timeout must be positive")
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        raise SystemExit(f"pdserve bench abuse: --phases {args.phases}: unknown {sorted(unknown)}; "
                         f"expected some of {','.join(PHASES)}")
    from gateway.tokenizer import Tokenizer

    model = resolve_model(args.model)
    if args.stuck_tokens + 16 > model_context(model):
        raise SystemExit(f"pdserve bench abuse: --stuck-tokens {args.stuck_tokens} leaves no room for the prompt in "
                         f"the model's context ({model_context(model)} tokens)")
    keys = ["bystander", "victim", "prober", "flooder", "bigprompt", *(f"stuck-{i}" for i in range(args.stuck))]
    gateway_args = (f"--max-in-flight-per-client={PER_CLIENT}", f"--max-queue-per-client={PER_CLIENT}",
                    f"--client-stall-timeout={args.client_stall_timeout:g}")
    log = tempfile.NamedTemporaryFile("w", prefix="pdserve-bench-abuse-", suffix=".log", delete=False)
    print(f"bench abuse: starting a cluster on {model} (its logs: {log.name})", file=sys.stderr, flush=True)
    saved = os.environ.get(API_KEYS_ENV)
    os.environ[API_KEYS_ENV] = ",".join(keys)  # the gateway inherits them
    try:
        with log, stderr_to(log.fileno()):
            cluster = start(ClusterConfig(prefill=1, decode=1, model=str(model), startup_timeout_s=300,
                                          colocate_below=min(512, model_context(model) // 2),
                                          gateway_args=gateway_args))
    finally:
        if saved is None:
            os.environ.pop(API_KEYS_ENV, None)
        else:
            os.environ[API_KEYS_ENV] = saved
    try:
        with cluster.channel(cluster.decode[0]) as channel:
            info = decode_pb2_grpc.DecodeStub(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=10)
        bench = Bench(args, cluster, info.model.vocab_size, info.model.max_model_len, Tokenizer.from_dir(model))
        asyncio.run(bench.run())
    finally:
        cluster.stop()
    result = _report(args, bench)
    publish(args, "abuse", result, lambda: _table(result), lambda path: plot(result, path))
    return 0 if result["verdict"]["ok"] else 1


def _report(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    failed = [f"{c['phase']}: {c['name']}" for c in bench.checks if not c["ok"]]
    return {
        "config": {"model": str(args.model), "stuck": args.stuck, "stuck_tokens": args.stuck_tokens,
                   "stuck_rcvbuf": args.stuck_rcvbuf,
                   "tokens": args.tokens, "alone": args.alone, "rounds": args.rounds,
                   "client_stall_timeout_s": args.client_stall_timeout, "phase_timeout_s": args.phase_timeout,
                   "phases": args.phases,
                   "per_client_caps": PER_CLIENT, "flood_streams": FLOOD, "big_prompts_per_s": BIG_PER_S,
                   "max_model_len": bench.max_model_len},
        "phases": bench.phases,
        "checks": bench.checks,
        "verdict": {"ok": not failed, "failed": failed},
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _table(result: dict[str, Any]) -> str:
    phases = result["phases"]
    alone = phases.get("alone", {})
    lines = [f"bystander alone: TTFT p50 {alone.get('ttft_p50_ms')} ms, p99 {alone.get('ttft_p99_ms')} ms; ITL p50 "
             f"{alone.get('itl_p50_ms')} ms, p99 {alone.get('itl_p99_ms')} ms, max {alone.get('itl_max_ms')} ms",
             f"{'phase':<12} {'check':<48} {'figure':>22} {'target':>18}  ok"]
    for c in result["checks"]:
        lines.append(f"{c['phase']:<12} {c['name']:<48} {_cell(c['value'])[:22]:>22} {c['target'][:18]:>18}  "
                     f"{'ok' if c['ok'] else 'FAILED'}")
    for name in ("flood", "big_prompts"):
        report = phases.get(name, {}).get(name)
        if report:
            lines.append(f"{name}: {report.get('statuses')}" + (
                f", refusals p50 {report['refusal_ms_p50']} ms, p99 {report['refusal_ms_p99']} ms"
                if report.get("refusal_ms_p50") is not None else ""))
    skipped = phases.get("bad_headers", {}).get("answers", {}).get("gRPC not UTF-8")
    if skipped:
        lines.append(f"gRPC not UTF-8: {skipped}")
    verdict = result["verdict"]
    lines.append("verdict: " + ("ok" if verdict["ok"] else "FAILED: " + "; ".join(verdict["failed"])))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """The bystander's TTFTs per phase (left); each figure with a numeric target as a share of it (right: under 1
    is within the target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, (ttft, share) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 3]})
    phases = result["phases"]
    samples = [("alone", phases.get("alone", {}).get("ttft_ms", [])),
               ("stuck", [phases["stuck"]["bystander_ttft_s"] * 1e3]
                if phases.get("stuck", {}).get("bystander_ttft_s") is not None else []),
               ("flood", phases.get("flood", {}).get("ttft_ms", [])),
               ("big prompts", phases.get("big_prompts", {}).get("ttft_ms", []))]
    for x, (_, values) in enumerate(samples):
        ttft.scatter([x] * len(values), values, s=14, alpha=0.6)
    ttft.set_xticks(range(len(samples)), [name for name, _ in samples])
    ttft.set_ylabel("bystander TTFT (ms)")
    ttft.set_yscale("log")
    ttft.set_title("bystander short requests")
    numeric = [c for c in result["checks"] if c["limit"] and isinstance(c["value"], (int, float))]
    names = [f"{c['phase']}: {c['name']}" for c in numeric]
    shares = [c["value"] / c["limit"] for c in numeric]
    share.barh(names, shares, color=["tab:green" if c["ok"] else "tab:red" for c in numeric])
    share.set_xscale("log")  # a figure 100x over its target beside one at half of it
    share.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: minor labels overlap
    share.axvline(1.0, color="black", linestyle="--")
    share.invert_yaxis()
    share.set_xlabel("figure / target (1 = the target)")
    share.set_title("verdict " + ("ok" if result["verdict"]["ok"] else "FAILED"))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.abuse", description=__doc__.splitlines()[0])
    add_args(parser)
    sys.exit(run(parser.parse_args()))
