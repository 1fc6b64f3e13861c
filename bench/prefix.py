"""`pdserve bench prefix`: prompts that share a long prefix, through prefill with the prefix cache off and on.

Two workloads, each run against a cluster (one prefill and one decode worker) with `--prefix-cache-mb 0` and
then with the cache on, one after the other in one run:
- shared: `--requests` prompts of a `--system`-token system prompt followed by a `--question`-token question,
  one at a time (TTFT is then the prefill's own time, not a queue's);
- multi-turn: `--conversations` conversations of `--turns` turns, each turn's prompt the whole conversation so
  far (earlier questions and replies) plus a new question; conversations take turns.
Per mode: TTFT p50 and p99 (seconds, from the gateway's timing), prompt tokens the prefill forward pass ran
(read from the prefill worker's `pdserve_prefill_computed_tokens_total`), prompt tokens served from the cache,
and requests per second. Prompts are random token ids (seeded), greedy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import add_output_args, publish
from bench.scenarios import percentile
from model_runner.loading import resolve_model
from pdserve.client import generate
from pdserve.cluster import ClusterConfig, start
from serving.metrics import scrape
from serving.models import DEFAULT_MODEL

MODES = ("off", "on")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--system", type=int, default=1000, help="shared system prompt tokens (default: %(default)s)")
    parser.add_argument("--question", type=int, default=50, help="question tokens (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=32, help="shared-prefix requests (default: %(default)s)")
    parser.add_argument("--conversations", type=int, default=3, help="multi-turn conversations (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default: %(default)s)")
    parser.add_argument("--reply", type=int, default=32, help="tokens generated per turn (default: %(default)s)")
    add_output_args(parser, "prefix")


def run(args: argparse.Namespace) -> int:
    model = str(resolve_model(args.model))
    rng = np.random.default_rng(0)

    def tokens(count: int) -> list[int]:
        return rng.integers(100, 30000, count).tolist()  # within any vocabulary pdserve's models have

    system = tokens(args.system)
    questions = [tokens(args.question) for _ in range(args.requests)]
    turns = [[tokens(args.question) for _ in range(args.turns)] for _ in range(args.conversations)]
    result: dict[str, Any] = {"system_tokens": args.system, "question_tokens": args.question,
                              "requests": args.requests, "multi_turn": {}}
    for mode in MODES:
        cache_mb = "0" if mode == "off" else "512"
        # every prompt on the prefill worker, whose prefix cache is measured (--placement threshold, nothing
        # colocated)
        cluster = start(ClusterConfig(prefill=1, decode=1, model=model, colocate_below=0,
                                      prefill_args=(f"--prefix-cache-mb={cache_mb}",),
                                      gateway_args=("--placement=threshold",), startup_timeout_s=300))
        try:
            address, metrics = cluster.gateway.address, cluster.prefill[0].metrics
            result[mode] = _measure(address, metrics, [system + q for q in questions], max_tokens=2)
            print(f"bench prefix: shared prefix, cache {mode} done", file=sys.stderr, flush=True)
            result["multi_turn"][mode] = _conversations(address, metrics, system[: args.system // 4], turns,
                                                        args.reply)
            print(f"bench prefix: multi-turn, cache {mode} done", file=sys.stderr, flush=True)
        finally:
            cluster.stop()
    for workload in (result, result["multi_turn"]):
        off, on = workload["off"], workload["on"]
        workload["ttft_p50_ratio"] = off["ttft_p50"] / on["ttft_p50"]
        workload["prefill_tokens_ratio"] = off["prefill_tokens"] / max(1, on["prefill_tokens"])
    return publish(args, "prefix", result, lambda: _table(result), lambda path: _plot(result, path))


def _computed(metrics: str) -> float:
    return scrape(metrics)["pdserve_prefill_computed_tokens_total"]


def _summary(ttfts: list[float], cached: int, computed: float, seconds: float) -> dict[str, float]:
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99), "prefill_tokens": computed,
            "cached_tokens": cached, "requests_per_s": len(ttfts) / seconds}


def _measure(address: str, metrics: str, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    before, started = _computed(metrics), time.perf_counter()
    ttfts, cached = [], 0
    for prompt in prompts:
        completion = generate(address, 120, token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                              ignore_eos=True)
        assert completion.timing is not None and completion.usage is not None
        ttfts.append(completion.timing.ttft_ms / 1e3)
        cached += completion.usage.cached_tokens
    return _summary(ttfts, cached, _computed(metrics) - before, time.perf_counter() - started)


def _conversations(address: str, metrics: str, system: list[int], turns: list[list[list[int]]],
                   reply: int) -> dict[str, float]:
    before, started = _computed(metrics), time.perf_counter()
    histories = [list(system) for _ in turns]
    ttfts, cached = [], 0
    for turn in range(len(turns[0])):
        for conversation, questions in enumerate(turns):  # conversations take turns
            prompt = histories[conversation] + questions[turn]
            completion = generate(address, 120, token_ids=prompt, max_tokens=reply, temperature=0.0,
                                  ignore_eos=True)
            assert completion.timing is not None and completion.usage is not None
            ttfts.append(completion.timing.ttft_ms / 1e3)
            cached += completion.usage.cached_tokens
            histories[conversation] = prompt + completion.token_ids
    return _summary(ttfts, cached, _computed(metrics) - before, time.perf_counter() - started)


def _table(result: dict[str, Any]) -> str:
    lines = [f"{result['requests']} requests: a {result['system_tokens']}-token system prompt + a "
             f"{result['question_tokens']}-token question, one at a time; then multi-turn conversations",
             f"{'workload':<12} {'cache':<6} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'prefill tokens':>15} "
             f"{'cached':>8} {'req/s':>7}"]
    for name, workload in (("shared", result), ("multi-turn", result["multi_turn"])):
        for mode in MODES:
            row = workload[mode]
            lines.append(f"{name:<12} {mode:<6} {row['ttft_p50']:>11.3f} {row['ttft_p99']:>11.3f} "
                         f"{row['prefill_tokens']:>15.0f} {row['cached_tokens']:>8.0f} {row['requests_per_s']:>7.2f}")
        lines.append(f"{'':<12} TTFT p50 {workload['ttft_p50_ratio']:.1f}x lower, "
                     f"{workload['prefill_tokens_ratio']:.1f}x fewer prefill tokens with the cache")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["shared", "multi-turn"]
    workloads = [result, result["multi_turn"]]
    width = 0.35
    for offset, mode, color in ((-width / 2, "off", "tab:grey"), (width / 2, "on", "tab:green")):
        positions = [i + offset for i in range(2)]
        left.bar(positions, [w[mode]["ttft_p50"] for w in workloads], width, label=f"cache {mode}", color=color)
        right.bar(positions, [w[mode]["prefill_tokens"] for w in workloads], width, label=f"cache {mode}",
                  color=color)
    for axis, label in ((left, "TTFT p50 (s)"), (right, "prompt tokens prefilled")):
        axis.set_xticks(range(2), names)
        axis.set_ylabel(label)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
