"""`pdserve bench hostile`: does a bystander's stream keep its pace while the hostile corpus runs beside it?

Issue 21's figure: while the hostile corpus runs, a bystander stream's ITL p99 stays within 1.3x of its p99
with no attack, in one run. The corpus is `pdserve bench soak`'s hostile kinds (bench/soak.py: oversized stop
strings and bodies, bad, extreme and denormal floats, out-of-range token ids, invalid JSON and UTF-8, unknown
and duplicate fields, slow and abandoned uploads, ...), sent back to back, `--concurrency` at a time, each once
per shuffled round.

A local cluster serves `--model` (the default model unless told otherwise). The bystander is one greedy gRPC
stream of `--tokens` tokens, read response by response; its ITL is the gap between responses. Rounds alternate,
`--rounds` of each: the bystander alone, then the bystander with the corpus running for the whole of its stream.
Alternating spreads the machine's drift over both sides; the gaps of each side are pooled across its rounds.
After the last round the live gauges must read 0 within `--drain-timeout` seconds, and every hostile request
must have got one of the outcomes its kind names.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from typing import Any

import aiohttp
import grpc

from bench.report import add_output_args, publish
from bench.scenarios import percentile
from bench.soak import KINDS, SERVED, Facts, Load, drain, model_context, stderr_to
from model_runner.loading import resolve_model
from pdserve.cluster import ClusterConfig, start
from protos import decode_pb2_grpc, gateway_pb2, worker_pb2
from serving.models import DEFAULT_MODEL

TARGET_RATIO = 1.3  # issue 21: the bystander's ITL p99 beside the corpus, over its p99 alone
MAX_TARGET_RATIO = 2.0  # issue 36: the bystander's largest gap beside the whole corpus, over its largest alone
HOSTILE = sorted(name for name, kind in KINDS.items() if not kind.weight)
# The kinds that are refused. The others (unknown or repeated fields, denormal floats, extreme top_k, abandoned
# streams...) are valid requests, served as any other: their prompts are work for the workers. So is the first of
# grpc_duplicate_id's two requests (a 32-token stream, whose id the refused second one reuses).
REFUSED = [name for name in HOSTILE if not KINDS[name].expected & SERVED and name != "grpc_duplicate_id"]
SIDES = ("alone", "refused", "all")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory or %(default)r")
    parser.add_argument("--rounds", type=int, default=3, help="bystander streams alone, and as many beside the "
                        "corpus, alternating (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per bystander stream (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="hostile requests in flight at once (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the corpus order's seed (default: %(default)s)")
    parser.add_argument("--colocate-below", type=int, default=None,
                        help="the cluster's --colocate-below (default: 512, as `pdserve cluster`, or half a small "
                        "model's context)")
    parser.add_argument("--decode-arg", action="append", default=[], metavar="FLAG",
                        help="extra flag for the decode worker, e.g. --decode-arg=--prefill-pass-ms=40")
    parser.add_argument("--drain-timeout", type=float, default=5.0,
                        help="seconds the live gauges get to reach 0 after the last round (default: %(default)s)")
    add_output_args(parser, "hostile")


class Corpus(Load):
    """Only the hostile kinds, each once per shuffled round; when each ran, to tell which one a stall came with."""

    def __init__(self, facts: Facts, channel: grpc.aio.Channel, session: aiohttp.ClientSession, seed: int,
                 kinds: list[str]) -> None:
        super().__init__(facts, channel, session, seed, hostile_kinds=kinds)
        self.spans: list[tuple[float, float, str]] = []  # (start, end, kind), perf_counter seconds
        self.arrivals: list[float] = []  # the bystander's responses while this corpus ran
        self.drawn = ""

    def draw(self, rng: random.Random) -> str:
        self.drawn = self.next_hostile()
        return self.drawn

    async def one(self, rng: random.Random) -> None:
        started = time.perf_counter()
        await super().one(rng)
        self.spans.append((started, time.perf_counter(), self.drawn))


async def bystander(load: Load, n: int, tokens: int) -> list[float]:
    """One greedy stream of `tokens` tokens: when each response came (perf_counter seconds)."""
    request = gateway_pb2.GenerateRequest(token_ids=[100 + (n * 37 + i) % 5000 for i in range(48)],
                                          max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                          request_id=f"bystander-{n}-{random.getrandbits(32):08x}")
    arrivals = []
    async for _ in load.stub.Generate(request, timeout=300):
        arrivals.append(time.perf_counter())
    return arrivals


def gaps_of(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


async def attack(load: Load, rng: random.Random, done: asyncio.Event) -> None:
    """Hostile requests one after another until `done`."""
    while not done.is_set():
        await load.one(rng)


async def rounds(facts: Facts, args: argparse.Namespace) -> tuple[dict[str, Corpus], dict[str, list[float]]]:
    """Per round: the bystander alone, beside the refused kinds, beside every kind. Each side's gaps, pooled, and
    the two corpora (their outcomes and when each request ran)."""
    async with grpc.aio.insecure_channel(facts.grpc) as channel, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=10),
            connector=aiohttp.TCPConnector(limit=0)) as session:
        corpora = {side: Corpus(facts, channel, session, args.seed, kinds=kinds) for side, kinds in
                   (("refused", REFUSED), ("all", HOSTILE))}
        await bystander(corpora["all"], -1, 16)  # warm-up: the first stream pays for connections and first passes
        gaps: dict[str, list[float]] = {side: [] for side in SIDES}
        streams = 0
        for r in range(args.rounds):
            for side in SIDES:
                streams += 1
                if side == "alone":
                    gaps[side] += gaps_of(await bystander(corpora["all"], streams, args.tokens))
                    continue
                corpus, done = corpora[side], asyncio.Event()
                attackers = [asyncio.ensure_future(attack(corpus, random.Random(f"{args.seed}:{r}:{i}"), done))
                             for i in range(args.concurrency)]
                await asyncio.sleep(0.2)  # the corpus is running when the stream starts
                try:
                    arrivals = await bystander(corpus, streams, args.tokens)
                finally:
                    done.set()
                    await asyncio.gather(*attackers)
                gaps[side] += gaps_of(arrivals)
                corpus.arrivals += arrivals
        return corpora, gaps


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.tokens < 2 or args.concurrency < 1:
        raise SystemExit("pdserve bench hostile: --rounds and --concurrency must be at least 1, --tokens at least 2")
    model = resolve_model(args.model)
    short_below = min(512, model_context(model) // 2)  # what the corpus's "short" prompts stay under
    colocate_below = short_below if args.colocate_below is None else args.colocate_below
    log = tempfile.NamedTemporaryFile("w", prefix="pdserve-bench-hostile-", suffix=".log", delete=False)
    print(f"bench hostile: starting a cluster on {model} (its logs: {log.name})", file=sys.stderr, flush=True)
    with log, stderr_to(log.fileno()):
        cluster = start(ClusterConfig(prefill=1, decode=1, model=str(model), startup_timeout_s=300,
                                      colocate_below=colocate_below, decode_args=tuple(args.decode_arg)))
    try:
        with cluster.channel(cluster.decode[0]) as channel:
            info = decode_pb2_grpc.DecodeStub(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=10)
        facts = Facts(cluster.gateway.address, cluster.gateway.http, info.model.vocab_size, info.model.max_model_len,
                      short_below)
        corpora, gaps = asyncio.run(rounds(facts, args))
        drained_s, gauges = drain(cluster, args.drain_timeout)
    finally:
        cluster.stop()
    result = _report(args, colocate_below, corpora, gaps, drained_s, gauges)
    publish(args, "hostile", result, lambda: _table(result))
    return 0 if result["verdict"]["ok"] else 1


def stalls(corpus: Corpus, alone: list[float]) -> dict[str, int]:
    """Per hostile kind, how many of the bystander's gaps beside the corpus that exceeded its p99 alone overlapped
    a request of that kind."""
    limit = percentile(sorted(alone), 99)
    counts: dict[str, int] = {}
    for a, b in zip(corpus.arrivals, corpus.arrivals[1:]):
        if b - a > limit:
            for start, end, name in corpus.spans:
                if start < b and end > a:
                    counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def _side(gaps: list[float]) -> dict[str, Any]:
    ordered = sorted(gaps)
    if not ordered:  # the stream came in one response (a tiny model's tokens can outrun the gateway's reads)
        return {"gaps": 0, "itl_p50_ms": None, "itl_p99_ms": None, "itl_max_ms": None}
    return {"gaps": len(gaps), "itl_p50_ms": round(percentile(ordered, 50) * 1e3, 2),
            "itl_p99_ms": round(percentile(ordered, 99) * 1e3, 2), "itl_max_ms": round(ordered[-1] * 1e3, 2)}


def _report(args: argparse.Namespace, colocate_below: int, corpora: dict[str, Corpus], gaps: dict[str, list[float]],
            drained_s: float | None, gauges: dict[str, dict[str, float]]) -> dict[str, Any]:
    sides = {side: _side(gaps[side]) for side in SIDES}
    ratios, max_ratios = _ratios(sides, "itl_p99_ms"), _ratios(sides, "itl_max_ms")
    unexpected = [u for corpus in corpora.values() for u in corpus.unexpected]
    refusal_ms = sorted(ms for corpus in corpora.values() for ms, _ in corpus.refusals)
    held = {f"{name} {key}": value for name, values in gauges.items() for key, value in values.items() if value}
    verdict = {"p99_ratio_beside_refusals_within_target": (ratios["refused"] or math.inf) <= TARGET_RATIO,
               "p99_ratio_beside_whole_corpus_within_target": (ratios["all"] or math.inf) <= TARGET_RATIO,
               "max_ratio_beside_whole_corpus_within_target": (max_ratios["all"] or math.inf) <= MAX_TARGET_RATIO,
               "no_unexpected_statuses": not unexpected, "live_gauges_zero": drained_s is not None}
    return {
        "config": {"model": str(args.model), "rounds": args.rounds, "tokens": args.tokens,
                   "concurrency": args.concurrency, "seed": args.seed, "target_ratio": TARGET_RATIO,
                   "max_target_ratio": MAX_TARGET_RATIO,
                   "colocate_below": colocate_below, "decode_args": args.decode_arg},
        "bystander": {**sides, "p99_ratio": ratios, "max_ratio": max_ratios},
        "corpus": {"kinds_refused": REFUSED, "kinds_served": sorted(set(HOSTILE) - set(REFUSED)),
                   "requests": {side: sum(sum(c.values()) for c in corpus.outcomes.values())
                                for side, corpus in corpora.items()},
                   "outcomes": {side: corpus.outcomes for side, corpus in corpora.items()},
                   "unexpected": unexpected,
                   "refusal_ms_p50": round(percentile(refusal_ms, 50), 2) if refusal_ms else None,
                   "refusal_ms_max": round(refusal_ms[-1], 2) if refusal_ms else None,
                   "kinds_beside_slow_gaps": {side: stalls(corpus, gaps["alone"]) for side, corpus in corpora.items()}},
        "drain": {"seconds": drained_s, "held": held},
        "verdict": {**verdict, "ok": all(verdict.values())},
    }


def _ratios(sides: dict[str, dict[str, Any]], key: str) -> dict[str, float | None]:
    """Each side's `key` over its figure alone (None without gaps or a figure alone)."""
    alone = sides["alone"][key]
    return {side: round(sides[side][key] / alone, 3) if alone and sides[side]["gaps"] else None
            for side in ("refused", "all")}


def _table(result: dict[str, Any]) -> str:
    by, corpus, config = result["bystander"], result["corpus"], result["config"]
    lines = [f"bystander ITL over {config['rounds']} rounds of {config['tokens']} tokens each",
             f"{'':>22} {'gaps':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 ratio':>10} {'max ratio':>10}"]
    for side, label in (("alone", "alone"), ("refused", f"beside {len(corpus['kinds_refused'])} refused kinds"),
                        ("all", f"beside all {len(corpus['kinds_refused']) + len(corpus['kinds_served'])} kinds")):
        row = by[side]
        ratio = by["p99_ratio"].get(side)
        cells = [f"{row[key]:>8.1f}" if row[key] is not None else f"{'-':>8}"
                 for key in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms")]
        max_ratio = by["max_ratio"].get(side)
        lines.append(f"{label:>22} {row['gaps']:>6} {' '.join(cells)} " + (f"{ratio:>10.2f}" if ratio else "")
                     + (f" {max_ratio:>10.2f}" if max_ratio else ""))
    lines.append(f"target: p99 ratio <= {config['target_ratio']}; max ratio beside all kinds <= "
                 f"{config['max_target_ratio']}")
    lines.append(f"corpus requests: {corpus['requests']}, {len(corpus['unexpected'])} unexpected; refusals p50 "
                 f"{corpus['refusal_ms_p50']} ms, max {corpus['refusal_ms_max']} ms")
    for side, counts in corpus["kinds_beside_slow_gaps"].items():
        if counts:
            lines.append(f"in flight during gaps over the p99 alone ({side}): " + ", ".join(
                f"{name} {n}" for name, n in list(counts.items())[:8]))
    lines.append(f"live gauges 0 after {result['drain']['seconds']} s; verdict "
                 f"{'ok' if result['verdict']['ok'] else 'FAILED'}: {result['verdict']}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.splitlines()[0])
    add_args(parser)
    sys.exit(run(parser.parse_args()))
