"""`pdserve bench gemm`: the GEMM kernels the fast runner could call, at the default model's shapes.

For each projection of SmolLM2-135M (fused q/k/v, o, gate, up, down, the tied lm_head) and each batch size,
this times stock `F.linear`, oneDNN with the weight prepacked once (`torch.ops.mkldnn._reorder_linear_weight` +
`_linear_pointwise`, what model_runner/llama.py uses), in float32 MKL's packed sgemm
(`torch.ops.mkl._mkl_reorder_linear_weight` + `_mkl_linear`) and, where it builds, model_runner/gemm.py's
small-M kernel ("tinygemm"). Weights cycle through as many copies as the model has layers, so they stream from
memory as in a real step instead of sitting in cache; the kernels take turns, one pass over the copies each per
repeat, with a read of 1 GiB (`torch.ones(2**28).sum()`, the memory-bandwidth ceiling decode GEMMs are compared
with) in every turn, so a noisy machine slows them alike. A large square matmul in the same run gives the core's
peak, which prefill-sized GEMMs are compared with. It also checks
batch invariance: whether a row's output has the same bits at every batch size (model_runner/llama.py's split
reductions are how the runner gets it where a kernel does not).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.report import add_output_args, publish
from model_runner import gemm

# (out, in) of each projection of SmolLM2-135M-Instruct (hidden 576, 9 q + 3 kv heads of 64, mlp 1536, vocab 49152)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
LAYERS = 30


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", default="1,8,64,256", help="rows (tokens) per GEMM (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16,float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over all copies (median)")
    add_output_args(parser, "gemm", plot=False)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows = []
    peaks = {}
    ones = torch.ones(2**28)  # 1 GiB to read: the memory-bandwidth ceiling
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        peaks[dtype_name] = _peak_gflops(dtype)
        for m in map(int, args.batch.split(",")):
            for name, (n, k) in SHAPES.items():
                rows.append(_measure(name, n, k, m, dtype, args.repeats, peaks[dtype_name], ones))
    result = {"threads": args.threads, "peak_gflops": peaks, "read_gbps": _read_gbps(ones, 5),
              "tinygemm": gemm.kernel_path(torch.bfloat16), "rows": rows}
    return publish(args, "gemm", result, lambda: _table(result))


def _peak_gflops(dtype: torch.dtype, size: int = 2048) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    times = []
    for _ in range(3):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * size**3 / min(times) / 1e9


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out


def _mkl(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0])
    return out


def _measure(name: str, n: int, k: int, m: int, dtype: torch.dtype, repeats: int, peak: float,
             ones: torch.Tensor) -> dict[str, Any]:
    copies = 1 if name == "lm_head" else LAYERS  # the head is 113 MB in fp32: one copy is already out of cache
    weights = [(torch.randn(n, k) * 0.05).to(dtype) for _ in range(copies)]
    x = torch.randn(m, k).to(dtype)
    kernels: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "F.linear": [functools.partial(F.linear, weight=w) for w in weights]}
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        kernels["onednn_packed"] = [functools.partial(_onednn, packed=p) for p in packed]
    except RuntimeError:  # oneDNN packs bfloat16 only on AVX-512 or AVX-NE-CONVERT CPUs: no column here
        pass
    if dtype == torch.float32:
        mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, m), w) for w in weights]
        kernels["mkl_packed"] = [functools.partial(_mkl, packed=p, weight=w) for p, w in mkl]
    if gemm.kernel_available():
        tiny = [gemm.pack(w) for w in weights]
        kernels["tinygemm"] = [functools.partial(gemm.linear, w=p) for p in tiny]
    row: dict[str, Any] = {"gemm": name, "n": n, "k": k, "m": m, "dtype": str(dtype).removeprefix("torch.")}
    times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
    reads = []
    for calls in kernels.values():
        for call in calls:
            call(x)
    for _ in range(repeats):  # in turns
        reads.append(_read_gbps(ones, 1))
        for kernel, calls in kernels.items():
            started = time.perf_counter()
            for call in calls:
                call(x)
            times[kernel].append((time.perf_counter() - started) / len(calls))
    row["read_gbps"] = statistics.median(reads)
    for kernel, calls in kernels.items():
        seconds = statistics.median(times[kernel])
        gbps = n * k * weights[0].element_size() / seconds / 1e9
        row[kernel] = {"us": seconds * 1e6, "weight_gbps": gbps, "of_read": gbps / row["read_gbps"],
                       "gflops": 2 * m * n * k / seconds / 1e9, "of_peak": 2 * m * n * k / seconds / 1e9 / peak,
                       "batch_invariant": _invariant(calls[0], k, dtype)}
    return row


def _read_gbps(ones: torch.Tensor, repeats: int) -> float:
    """The read bandwidth of `ones.sum()` (best of `repeats`)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        ones.sum()
        times.append(time.perf_counter() - started)
    return ones.numel() * ones.element_size() / min(times) / 1e9


def _invariant(call: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype) -> bool:
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    alone = torch.cat([call(x[i : i + 1]) for i in range(8)])
    return all(torch.equal(call(x[:m])[:8], alone) for m in (8, 16, 33, 64))


def _table(result: dict[str, Any]) -> str:
    peaks = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in result["peak_gflops"].items())
    lines = [f"GEMMs at SmolLM2-135M shapes, {result['threads']} thread(s); peak (2048^3 matmul): {peaks}; "
             f"read {result['read_gbps']:.1f} GB/s (best of 5); tinygemm path: {result['tinygemm']}",
             f"{'dtype':>8} {'m':>4} {'gemm':>8} | {'F.linear us':>11} {'GB/s':>5} | {'oneDNN us':>9} {'GB/s':>5} "
             f"{'read':>4} {'peak':>5} {'inv':>3} | {'MKL us':>8} {'GB/s':>5} | {'tiny us':>8} {'GB/s':>5} "
             f"{'read':>4} {'inv':>3} | {'read GB/s':>9}"]
    for r in result["rows"]:
        f, o = r["F.linear"], r.get("onednn_packed")
        mkl, tiny = r.get("mkl_packed"), r.get("tinygemm")
        onednn_cols = (f"{o['us']:>9.0f} {o['weight_gbps']:>5.1f} {o['of_read']:>4.0%} {o['of_peak']:>5.0%} "
                       f"{'yes' if o['batch_invariant'] else 'no':>3}"
                       if o else f"{'-':>9} {'-':>5} {'-':>4} {'-':>5}   -")
        mkl_cols = f"{mkl['us']:>8.0f} {mkl['weight_gbps']:>5.1f}" if mkl else f"{'-':>8} {'-':>5}"
        tiny_cols = (f"{tiny['us']:>8.0f} {tiny['weight_gbps']:>5.1f} {tiny['of_read']:>4.0%} "
                     f"{'yes' if tiny['batch_invariant'] else 'no':>3}" if tiny else f"{'-':>8} {'-':>5} {'-':>4}   -")
        lines.append(f"{r['dtype']:>8} {r['m']:>4} {r['gemm']:>8} | {f['us']:>11.0f} {f['weight_gbps']:>5.1f} | "
                     f"{onednn_cols} | {mkl_cols} | {tiny_cols} | "
                     f"{r['read_gbps']:>9.1f}")
    return "\n".join(lines)
