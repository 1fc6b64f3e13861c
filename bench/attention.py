"""`python -m bench.attention`: paged decode attention against its memory-bandwidth floor.

A decode step's attention reads every sequence's keys and values once per layer, so its floor is those bytes
over the read bandwidth: torch.ones(2**28).sum(), best of 5, measured in the same run. Each layer has its own
cache and together they are larger than the last-level cache, as in a real step, so each layer's is cold
when it runs. On a shared machine both numbers drift, so the step and the bandwidth are measured in turns:
each is reported as its best, and their ratio also as the median over adjacent pairs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from model_runner.attention import kernel_path, paged_decode_attention, reference_decode_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(dtype: torch.dtype, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    # (layers, 2, num_blocks, block_size, Hkv, D), as the runner allocates it
    cache = torch.randn(args.layers, 2, num_blocks, args.block_size, args.kv_heads, args.head_dim).to(dtype)
    # Each sequence's blocks scattered through the cache in random order (the worst case for prefetching), or
    # with --sequential-blocks one after another
    order = torch.arange if args.sequential_blocks else torch.randperm
    block_tables = order(num_blocks, dtype=torch.int32).view(args.batch, blocks_per_seq)
    context_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.layers, args.batch, args.q_heads, args.head_dim).to(dtype)
    scale = args.head_dim**-0.5
    ones = torch.ones(2**28)

    def step(attention: Attention) -> None:
        for layer in range(args.layers):
            attention(q[layer], cache[layer, 0], cache[layer, 1], block_tables, context_lens, scale)

    step(paged_decode_attention)  # builds the kernel if needed, warms up
    kernel_s, sum_s = [], []
    for _ in range(args.steps):
        kernel_s.append(_timed(lambda: step(paged_decode_attention)))
        sum_s.append(_timed(ones.sum))
    reference_s = min(_timed(lambda: step(reference_decode_attention)) for _ in range(3))
    kv_bytes = args.layers * args.batch * args.context * args.kv_heads * args.head_dim * 2 * cache.element_size()
    sum_bytes = ones.numel() * ones.element_size()
    # Each step against the floor measured just after it, so drift in what the neighbours use cancels
    paired = sorted(k / (s * kv_bytes / sum_bytes) for k, s in zip(kernel_s, sum_s))
    return {"kernel_ms": min(kernel_s) * 1e3, "reference_ms": reference_s * 1e3, "kv_mb": kv_bytes / 1e6,
            "bandwidth_gb_s": sum_bytes / min(sum_s) / 1e9, "floor_ms": kv_bytes / sum_bytes * min(sum_s) * 1e3,
            "paired_ratio": paired[len(paired) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30)  # SmolLM2-135M's shape by default
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sequential-blocks", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, context {args.context}, {args.layers} layers, Hq {args.q_heads}, "
          f"Hkv {args.kv_heads}, D {args.head_dim}, block {args.block_size}, {args.threads} thread(s), "
          f"{'sequential' if args.sequential_blocks else 'shuffled'} blocks")
    for dtype in (torch.float32, torch.bfloat16):
        r = bench(dtype, args)
        name = f"{str(dtype).removeprefix('torch.')} ({kernel_path(args.head_dim, dtype)})"
        print(f"{name:>22}: step {r['kernel_ms']:.2f} ms, floor {r['floor_ms']:.2f} ms ({r['kv_mb']:.0f} MB at "
              f"{r['bandwidth_gb_s']:.1f} GB/s): {r['kernel_ms'] / r['floor_ms']:.2f}x the floor (median of "
              f"paired runs {r['paired_ratio']:.2f}x); reference {r['reference_ms']:.1f} ms "
              f"({r['reference_ms'] / r['kernel_ms']:.1f}x the kernel's time)")


if __name__ == "__main__":
    main()
