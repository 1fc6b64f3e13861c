"""`pdserve bench prefill`: when batching short prompts pays, what chunking a long one costs, and threads.

The prefill scheduler's defaults come from here (engine/scheduler.py). For each prompt length, it runs
`--batch` prompts one by one and then as one right-padded pass (`forward.prefill_pass`), and reports the
speedup. It runs a `--long`-token prompt whole and in chunks of each `--chunks` size, and reports the ratio.
Every measurement is the best of `--repeats`, measured side by side in one run, on `--threads` threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from bench.report import add_output_args, publish
from model_runner.forward import prefill_pass
from model_runner.loading import LoadedModel, ModelConfig
from serving.models import DEFAULT_MODEL


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--lengths", default="16,32,64,128,256", help="short prompt lengths to batch")
    parser.add_argument("--batch", type=int, default=4, help="prompts per batched pass (default: %(default)s)")
    parser.add_argument("--long", type=int, default=1500, help="the long prompt's length (default: %(default)s)")
    parser.add_argument("--chunks", default="128,256,512", help="chunk sizes for the long prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as a prefill worker of `pdserve "
                        "cluster` gets on 2 cores (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per measurement")
    add_output_args(parser, "prefill")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    # PDSERVE_PROMPT_GEMM picks the prompt GEMMs measured, as it does a worker's (its --prompt-gemm)
    runner = ModelConfig(model=args.model, threads=args.threads,
                         prompt_gemm=os.environ.get("PDSERVE_PROMPT_GEMM", "auto")).load()
    vocab = runner.spec.vocab_size
    generator = torch.Generator().manual_seed(0)

    def prompt(length: int) -> list[int]:
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    def best(work: Callable[[], object]) -> float:
        work()  # warm-up
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        return min(times)

    batching = []
    for length in (int(n) for n in args.lengths.split(",")):
        prompts = [prompt(length) for _ in range(args.batch)]
        alone = best(partial(_one_by_one, runner, prompts))
        batched = best(partial(_batched, runner, prompts))
        batching.append({"length": length, "batch": args.batch, "one_by_one_s": alone, "batched_s": batched,
                         "speedup": alone / batched})
    print("bench prefill: batching done", file=sys.stderr, flush=True)
    long_prompt = prompt(args.long)
    whole = best(partial(_chunked, runner, long_prompt, args.long))
    chunking = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        seconds = best(partial(_chunked, runner, long_prompt, chunk))
        chunking.append({"chunk": chunk, "seconds": seconds, "over_whole": seconds / whole})
    result: dict[str, Any] = {"threads": args.threads, "batching": batching,
                              "long": {"tokens": args.long, "whole_s": whole, "chunked": chunking}}
    return publish(args, "prefill", result, lambda: _table(result), lambda path: _plot(result, path))


def _one_by_one(runner: LoadedModel, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        prefill_pass(runner, [prompt], DynamicCache())


def _batched(runner: LoadedModel, prompts: list[list[int]]) -> None:
    prefill_pass(runner, prompts, DynamicCache())


def _chunked(runner: LoadedModel, prompt: list[int], chunk: int) -> None:
    cache = DynamicCache()
    for start in range(0, len(prompt), chunk):
        prefill_pass(runner, [prompt[start : start + chunk]], cache)


def _table(result: dict[str, Any]) -> str:
    lines = [f"Prefill on {result['threads']} thread(s): batched against one by one",
             f"{'length':>7} {'batch':>6} {'one by one s':>13} {'batched s':>10} {'speedup':>8}"]
    for row in result["batching"]:
        lines.append(f"{row['length']:>7} {row['batch']:>6} {row['one_by_one_s']:>13.3f} {row['batched_s']:>10.3f} "
                     f"{row['speedup']:>7.2f}x")
    long = result["long"]
    lines.append(f"A {long['tokens']}-token prompt: whole {long['whole_s']:.2f} s")
    for row in long["chunked"]:
        lines.append(f"  chunks of {row['chunk']:>4}: {row['seconds']:.2f} s ({row['over_whole']:.2f}x)")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    rows = result["batching"]
    left.bar([str(r["length"]) for r in rows], [r["speedup"] for r in rows], color="tab:blue")
    left.axhline(1.0, color="grey", linewidth=1)
    left.set_xlabel(f"prompt length ({rows[0]['batch']} prompts per pass)")
    left.set_ylabel("batched speedup")
    long = result["long"]
    labels = ["whole"] + [str(r["chunk"]) for r in long["chunked"]]
    right.bar(labels, [long["whole_s"]] + [r["seconds"] for r in long["chunked"]], color="tab:orange")
    right.set_xlabel(f"{long['tokens']}-token prompt: chunk size")
    right.set_ylabel("seconds")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
