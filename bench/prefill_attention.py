"""`python -m bench.prefill_attention`: causal prefill attention, the C++ kernel against torch SDPA.

One layer's attention over a whole prompt (start 0), SmolLM2-135M's heads by default. The kernel, SDPA and a
2048^3 bfloat16 matmul (the machine's practical bf16 peak) run in turns in one process, each reported as its
best; the speedup also as the median over adjacent pairs, so drift in what the machine's other tenants use
cancels. At one thread the time is the calling thread's CPU time (the work runs on it), which leaves out the
time other processes hold the core; with more threads it is wall time. GFLOP/s count the causal half only:
4 Hq D T (T + 1) / 2.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch

from model_runner.prefill_attention import causal_attention, kernel_path, load_kernel, reference_attention


def _timer(threads: int) -> Callable[[Callable[[], object]], float]:
    clock = time.thread_time if threads == 1 else time.perf_counter

    def timed(fn: Callable[[], object]) -> float:
        start = clock()
        fn()
        return clock() - start

    return timed


def bench(tokens: int, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.q_heads, tokens, args.head_dim, generator=gen).to(dtype)
    k = torch.randn(args.kv_heads, tokens, args.head_dim, generator=gen).to(dtype)
    v = torch.randn(args.kv_heads, tokens, args.head_dim, generator=gen).to(dtype)
    a = torch.randn(2048, 2048, generator=gen).to(torch.bfloat16)
    b = torch.randn(2048, 2048, generator=gen).to(torch.bfloat16)
    scale = args.head_dim**-0.5
    timed = _timer(args.threads)
    kernel = timed(lambda: causal_attention(q, k, v, scale))  # warm-up, and a measure of how long a turn takes
    sdpa = timed(lambda: reference_attention(q, k, v, scale))
    timed(lambda: a @ b)
    turns = max(3, min(args.turns, int(args.seconds / (kernel + sdpa))))
    kernel_s: list[float] = []
    sdpa_s: list[float] = []
    matmul_s: list[float] = []
    for _ in range(turns):
        kernel_s.append(timed(lambda: causal_attention(q, k, v, scale)))
        sdpa_s.append(timed(lambda: reference_attention(q, k, v, scale)))
        if len(matmul_s) < 5:
            matmul_s.append(timed(lambda: a @ b))
    flops = 4 * args.q_heads * args.head_dim * tokens * (tokens + 1) / 2
    paired = sorted(s / k for k, s in zip(kernel_s, sdpa_s))
    return {"kernel_ms": min(kernel_s) * 1e3, "sdpa_ms": min(sdpa_s) * 1e3, "turns": turns,
            "speedup": min(sdpa_s) / min(kernel_s), "paired_speedup": paired[len(paired) // 2],
            "kernel_gflops": flops / min(kernel_s) / 1e9, "sdpa_gflops": flops / min(sdpa_s) / 1e9,
            "matmul_gflops": 2 * 2048**3 / min(matmul_s) / 1e9}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", default="256,1500,4000", help="prompt lengths, comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--q-heads", type=int, default=9)  # SmolLM2-135M's shape by default
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=20, help="most turns per row")
    parser.add_argument("--seconds", type=float, default=20.0, help="about how long a row may take")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    assert load_kernel(), "the kernel failed to build"
    print(f"kernel ready in {time.perf_counter() - began:.1f} s; {_cpu_name()}, {os.cpu_count()} CPUs, "
          f"{args.threads} thread(s), torch {torch.__version__}; Hq {args.q_heads}, Hkv {args.kv_heads}, "
          f"D {args.head_dim}")
    print("| T | dtype | path | SDPA ms | kernel ms | speedup (paired) | kernel GFLOP/s | SDPA GFLOP/s "
          "| bf16 matmul GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            r = bench(tokens, dtype, args)
            print(f"| {tokens} | {str(dtype).removeprefix('torch.')} | {kernel_path(args.head_dim, dtype)} "
                  f"| {r['sdpa_ms']:.2f} | {r['kernel_ms']:.2f} | {r['speedup']:.2f}x ({r['paired_speedup']:.2f}x) "
                  f"| {r['kernel_gflops']:.0f} | {r['sdpa_gflops']:.0f} | {r['matmul_gflops']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
