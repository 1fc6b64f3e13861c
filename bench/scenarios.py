"""`pdserve bench scenarios`: the NanoGPT experiment's six scenarios, colocated against disaggregated.

Each scenario is a fixed list of requests (arrival time, prompt length, tokens to generate), scaled to the
default model: prompts of hundreds to thousands of tokens. Both modes run on the same cores, one after the
other, with the same requests:
- disaggregated: one prefill and one decode worker, each pinned to half of the cores;
- colocated: one decode worker that prefills too (chunked), with all the cores.
Per mode: wall time, generated tokens/s, TTFT and latency (mean, p50, p99) and inter-token latency (p50, p99,
max), all in seconds. A request refused for want of a decode slot is retried every 50 ms, and the wait counts
in its TTFT. Prompts are random token ids, greedy, ignore_eos, so every run generates the same
number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.report import add_output_args, publish
from model_runner.loading import resolve_model
from pdserve.cluster import Cluster, ClusterConfig, start
from protos import gateway_pb2, gateway_pb2_grpc
from serving.models import DEFAULT_MODEL

MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Request:
    at_s: float  # arrival, seconds after the scenario starts
    prompt_tokens: int
    max_tokens: int


def _smoke(scale: float) -> list[Request]:
    return [Request(i * 1.0, scaled(128, scale), scaled(32, scale)) for i in range(4)]


def _staggered(scale: float) -> list[Request]:
    return [Request(i * 0.75, scaled(192 + 96 * (i % 4), scale), scaled(48, scale)) for i in range(8)]


def _long_prompts(scale: float) -> list[Request]:
    chats = [Request(0.2 * i, scaled(64, scale), scaled(96, scale)) for i in range(3)]
    documents = [Request(1.0 + 3.0 * i, scaled(1500, scale), scaled(16, scale)) for i in range(3)]
    return sorted(chats + documents, key=lambda r: r.at_s)


def _long_decode(scale: float) -> list[Request]:
    return [Request(0.25 * i, scaled(96, scale), scaled(256, scale)) for i in range(4)]


def _stress(scale: float) -> list[Request]:
    return [Request(0.05 * i, scaled(64 + 48 * (i % 8), scale), scaled(64, scale)) for i in range(16)]


def _batch_pressure(scale: float) -> list[Request]:
    return [Request(0.0, scaled(160, scale), scaled(48, scale)) for _ in range(12)]  # 12 requests, 8 decode slots


SCENARIOS: dict[str, Callable[[float], list[Request]]] = {
    "smoke": _smoke, "staggered": _staggered, "long_prompts": _long_prompts, "long_decode": _long_decode,
    "stress": _stress, "batch_pressure": _batch_pressure,
}


def scaled(tokens: int, scale: float) -> int:
    return max(2, round(tokens * scale))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="which to run (default: all six)")
    add_mode_args(parser, "scenarios")


def add_mode_args(parser: argparse.ArgumentParser, results: str) -> None:
    """The flags of a benchmark that runs a workload through both modes (this one and `bench interference`)."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt and output length")
    parser.add_argument("--max-seqs", type=int, default=8, help="decode slots per decode worker (default: 8)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="colocated chunk size (default: 256)")
    parser.add_argument("--colocate-below", type=int, default=0, metavar="TOKENS",
                        help="disaggregated mode: prompts shorter than this are prefilled on the decode worker "
                        "(conditional disaggregation; default: %(default)s, never)")
    parser.add_argument("--modes", default=",".join(MODES), type=_modes,
                        help="which modes to run, e.g. colocated when tuning the baseline (default: both)")
    add_output_args(parser, results)


def _modes(value: str) -> list[str]:
    chosen = [mode.strip() for mode in value.split(",") if mode.strip()]
    if not chosen or set(chosen) - set(MODES):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a comma-separated subset of {', '.join(MODES)}")
    return chosen


def start_mode(mode: str, model_dir: Path, args: argparse.Namespace) -> Cluster:
    """A cluster for `mode`: colocated (one decode worker that prefills too, every core) or disaggregated
    (one prefill and one decode worker, each pinned to half of the cores)."""
    return start(ClusterConfig(
        prefill=0 if mode == "colocated" else 1, decode=1, model=str(model_dir),
        decode_args=(f"--max-seqs={args.max_seqs}", f"--prefill-chunk={args.prefill_chunk}"),
        colocate_below=args.colocate_below, gateway_args=("--placement=threshold",)))  # the modes as configured


def run(args: argparse.Namespace) -> int:
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"pdserve bench scenarios: unknown scenario(s) {unknown}; known: {sorted(SCENARIOS)}")
    model_dir = resolve_model(args.model)
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    timelines: dict[str, dict[str, list[list[float]]]] = {name: {} for name in names}
    for mode in args.modes:
        cluster = start_mode(mode, model_dir, args)
        try:
            for name in names:
                requests = SCENARIOS[name](args.scale)
                records = asyncio.run(drive(cluster.gateway.address, requests))
                results[name][mode] = metrics(records)
                timelines[name][mode] = [r.token_times for r in records]
                print(f"bench scenarios: {name} ({mode}) done in {results[name][mode]['wall_s']:.1f} s",
                      file=sys.stderr, flush=True)
        finally:
            cluster.stop()
    document = {"machine": {"cores": len(os.sched_getaffinity(0))}, "scale": args.scale, "max_seqs": args.max_seqs,
                "prefill_chunk": args.prefill_chunk, "scenarios": results}
    return publish(args, "scenarios", results, lambda: _table(results), lambda path: plot(results, timelines, path),
                   document)


@dataclass
class Record:
    request: Request
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # seconds after `sent`, one per token


async def drive(address: str, requests: list[Request]) -> list[Record]:
    """Send every request at its arrival time and record when each of its tokens came back."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, r.prompt_tokens).tolist() for r in requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await _one(stub, Record(Request(0, 8, 2)), [1] * 8, time.perf_counter())  # warm-up
        started = time.perf_counter()
        records = [Record(r) for r in requests]
        await asyncio.gather(*(_one(stub, record, prompt, started) for record, prompt in zip(records, prompts)))
    return records


async def _one(stub: gateway_pb2_grpc.GatewayStub, record: Record, prompt: list[int], started: float) -> None:
    await asyncio.sleep(max(0.0, started + record.request.at_s - time.perf_counter()))
    record.sent = time.perf_counter()
    request = gateway_pb2.GenerateRequest(token_ids=prompt, max_tokens=record.request.max_tokens, temperature=0.0,
                                          ignore_eos=True)
    while True:
        try:
            async for response in stub.Generate(request, timeout=1800):
                now = time.perf_counter() - record.sent
                record.token_times += [now] * len(response.token_ids)
            return
        except grpc.aio.AioRpcError as exc:
            # Refused after the gateway's queue timeout (every decode slot taken all along): retry as a client
            # would; the wait counts in this request's TTFT.
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or record.token_times:
                raise
            await asyncio.sleep(0.05)


def metrics(records: list[Record]) -> dict[str, float]:
    ttfts = [r.token_times[0] for r in records]
    latencies = [r.token_times[-1] for r in records]
    itls = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:])]
    first_sent = min(r.sent for r in records)
    wall = max(r.sent + r.token_times[-1] for r in records) - first_sent
    generated = sum(len(r.token_times) for r in records)
    return {
        "wall_s": wall, "gen_tok_per_s": generated / wall, "requests": len(records), "generated_tokens": generated,
        "ttft_mean": statistics.fmean(ttfts), "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
        "latency_mean": statistics.fmean(latencies), "latency_p50": percentile(latencies, 50),
        "latency_p99": percentile(latencies, 99),
        "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99), "itl_max": max(itls, default=0.0),
    }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'scenario':<15} {'mode':<14} {'wall s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'lat p50':>8} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8}"]
    for name, modes in results.items():
        for mode, m in modes.items():
            lines.append(f"{name:<15} {mode:<14} {m['wall_s']:>7.1f} {m['gen_tok_per_s']:>7.1f} "
                         f"{m['ttft_p50']:>9.3f} {m['ttft_p99']:>9.3f} {m['latency_p50']:>8.2f} "
                         f"{m['itl_p50']:>8.3f} {m['itl_p99']:>8.3f} {m['itl_max']:>8.3f}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], timelines: dict[str, dict[str, list[list[float]]]],
          path: Path) -> None:
    """Per scenario: the TTFT CDF of both modes (top) and every token's arrival, request by request (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 7), squeeze=False)
    for column, name in enumerate(names):
        cdf, timeline = axes[0][column], axes[1][column]
        for mode, color in zip(MODES, ("tab:orange", "tab:blue")):
            if mode not in timelines[name]:
                continue
            ttfts = sorted(times[0] for times in timelines[name][mode])
            cdf.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", color=color,
                     label=mode)
            for row, times in enumerate(timelines[name][mode]):
                offset = 0.2 if mode == "disaggregated" else -0.2
                timeline.plot(times, [row + offset] * len(times), "|", color=color, markersize=4)
        cdf.set_title(name)
        cdf.set_xlabel("TTFT (s)")
        timeline.set_xlabel("token arrival after send (s)")
        timeline.set_ylabel("request")
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
