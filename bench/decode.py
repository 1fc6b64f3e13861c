"""`pdserve bench decode`: the decode step against its memory-bandwidth floor.

A decode step must read every weight once and each sequence's whole KV cache; on a CPU that is the floor:
(weight bytes + KV bytes read) / read bandwidth. This runs the decode engine's own step (`forward.decode_step`
over a paged KV cache) at a batch of sequences with `--context` tokens each, and measures the read bandwidth
of the same threads in the same run (a sum over a buffer far larger than the caches). Each --dtype given is
measured in turn; the first is the headline (`step_ms`, `floor_ms` in --json).

A step must also do its arithmetic: two flops per weight per sequence, and four per cached element of every q
head's keys and values. Over the matmul rate these threads reach (the better of a large float32 and bfloat16
matmul, measured in the same run), that is the compute floor (`compute_floor_ms`). Where it is above the memory
floor the step cannot reach the memory floor on this CPU: on one AVX2 core without bfloat16 dot-product
instructions, a bfloat16 step at batch 8 is bound by its arithmetic, not by its reads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from bench.report import add_output_args, publish
from model_runner import forward
from model_runner.loading import LoadedModel, ModelConfig
from model_runner.paged_cache import BLOCK_SIZE, PagedKVCache
from serving.models import DEFAULT_MODEL


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="tokens already cached per sequence")
    parser.add_argument("--dtype", default="bfloat16,float32", help="dtypes to measure, the first is the headline")
    parser.add_argument("--runner", default="fast,hf", help="runners to measure (model_runner/loading.RUNNERS)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as a decode worker of `pdserve "
                        "cluster` gets on 2 cores (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per dtype (after 3 warm-up steps)")
    add_output_args(parser, "decode", plot=False)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    read_gbps = read_bandwidth()
    matmul_gflops = max(matmul_rate(torch.float32), matmul_rate(torch.bfloat16))
    variants = []
    for name in args.runner.split(","):
        for dtype in args.dtype.split(","):
            runner = ModelConfig(model=args.model, dtype=dtype, threads=args.threads, runner=name).load()
            variants.append(_measure(runner, args, read_gbps, matmul_gflops))
            del runner
            print(f"bench decode: {name} {dtype} done", file=sys.stderr, flush=True)
    head = variants[0]
    result = {"step_ms": head["step_ms"], "floor_ms": head["floor_ms"], "batch": args.batch, "context": args.context,
              "threads": args.threads, "read_gbps": read_gbps, "matmul_gflops": matmul_gflops, "variants": variants}
    return publish(args, "decode", result, lambda: _table(result))


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s at which this process's torch threads read memory: the best of `repeats` sums over `nbytes`."""
    data = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def matmul_rate(dtype: torch.dtype, n: int = 1536, repeats: int = 3) -> float:
    """GFLOP/s of this process's torch threads on an n x n matmul in `dtype`: the best of `repeats`, or of the
    first call alone if it took over a second (bfloat16 on a CPU without its instructions: ~1 GFLOP/s)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    started = time.perf_counter()
    torch.mm(a, b)  # also the warm-up: packing buffers, the kernel's first call
    best = time.perf_counter() - started
    for _ in range(repeats if best < 1 else 0):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best / 1e9


def _measure(runner: LoadedModel, args: argparse.Namespace, read_gbps: float, matmul_gflops: float) -> dict[str, Any]:
    spec = runner.spec
    tokens_each = args.context + args.steps + 8
    cache = PagedKVCache(spec.num_layers, args.batch * -(-tokens_each // BLOCK_SIZE), spec.num_kv_heads, spec.head_dim,
                         runner.dtype, runner.device)
    generator = torch.Generator().manual_seed(0)
    # a realistic cache: random values in every position the steps will read, each sequence's blocks shuffled
    # through the pool as they are after a while of joins and leaves
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator))
    order = torch.randperm(cache.num_blocks, generator=generator).tolist()
    per = cache.num_blocks // args.batch
    tables = [order[i * per : (i + 1) * per] for i in range(args.batch)]
    tokens = torch.randint(0, spec.vocab_size, (args.batch,), generator=generator).tolist()
    times = []
    for step in range(args.steps + 3):
        positions = [args.context + step] * args.batch
        started = time.perf_counter()
        logits = forward.decode_step(runner, cache, tokens, tables, positions)
        tokens = logits.argmax(-1).tolist()
        if step >= 3:
            times.append(time.perf_counter() - started)
    weight_bytes = runner.fast.weight_bytes() if runner.fast is not None else sum(
        {p.data_ptr(): p.numel() * p.element_size() for p in runner.model.parameters()}.values())
    kv_bytes = args.batch * (args.context + args.steps // 2) * spec.kv_bytes_per_token  # the mean step's reads
    step_ms = statistics.median(times) * 1e3
    floor_ms = (weight_bytes + kv_bytes) / (read_gbps * 1e9) * 1e3
    # every weight multiplies every sequence's token; each q head's scores and weighted sum over its cached rows
    config = runner.model.config if runner.fast is None else None  # the reference runner's heads, as the fast one's
    q_per_kv = (runner.fast.num_heads // runner.fast.num_kv_heads if config is None
                else config.num_attention_heads // (getattr(config, "num_key_value_heads", None)
                                                    or config.num_attention_heads))
    flops = 2 * weight_bytes / runner.dtype.itemsize * args.batch + 2 * q_per_kv * kv_bytes / runner.dtype.itemsize
    compute_floor_ms = flops / (matmul_gflops * 1e9) * 1e3
    return {"dtype": spec.dtype, "runner": runner.runner_name, "step_ms": step_ms, "floor_ms": floor_ms,
            "step_over_floor": step_ms / floor_ms, "compute_floor_ms": compute_floor_ms,
            "step_over_compute_floor": step_ms / compute_floor_ms, "gflop_per_step": flops / 1e9,
            "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
            "tokens_per_s": args.batch / step_ms * 1e3, "step_ms_samples": [t * 1e3 for t in times]}


def _table(result: dict[str, Any]) -> str:
    lines = [f"Decode step at batch {result['batch']}, {result['context']} cached tokens each, {result['threads']} "
             f"thread(s); read bandwidth {result['read_gbps']:.1f} GB/s, matmul {result['matmul_gflops']:.0f} GFLOP/s",
             f"{'runner':>6} {'dtype':>9} {'step ms':>8} {'floor ms':>9} {'step/floor':>10} {'compute floor':>13} "
             f"{'step/compute':>12} {'tok/s':>7} {'weights MB':>10} {'KV MB':>6}"]
    for v in result["variants"]:
        lines.append(f"{v['runner']:>6} {v['dtype']:>9} {v['step_ms']:>8.1f} {v['floor_ms']:>9.1f} "
                     f"{v['step_over_floor']:>9.2f}x {v['compute_floor_ms']:>13.1f} "
                     f"{v['step_over_compute_floor']:>11.2f}x "
                     f"{v['tokens_per_s']:>7.1f} {v['weight_bytes'] / 1e6:>10.0f} {v['kv_bytes_per_step'] / 1e6:>6.0f}")
    return "\n".join(lines)
