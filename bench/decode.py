"""`pdserve bench decode`: the decode step against its memory-bandwidth floor.

A decode step must read every weight once and each sequence's whole KV cache; that is the floor:
(weight bytes + KV bytes read) / read bandwidth. This runs the decode engine's own step (`forward.decode_step`
over a paged KV cache) at a batch of sequences with `--context` tokens each, and measures the bandwidth in the
same run: on the CPU, a sum by the same threads over a buffer far larger than the caches; on a GPU (`--device
cuda`), a device-to-device copy, counting the bytes read and written. Each --dtype given is measured in turn; the
first is the headline (`step_ms`, `floor_ms` in --json). `--random` measures Llamas of public shapes with random
weights instead of --model (the default model is too small to load a GPU).

A step must also do its arithmetic: two flops per weight per sequence, and four per cached element of every q
head's keys and values. Over the matmul rate measured in the same run, that is the compute floor
(`compute_floor_ms`): on the CPU the better of a large float32 and bfloat16 matmul (the kernels multiply
bfloat16 in float32), on a GPU the rate of the step's own dtype. Where it is above the memory floor the step
cannot reach the memory floor: on one AVX2 core without bfloat16 dot-product instructions, a bfloat16 step at
batch 8 is bound by its arithmetic, not by its reads; so is a float32 step at batch 64 on a GPU's CUDA cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.report import add_output_args, publish
from model_runner import forward
from model_runner.loading import DTYPES, LoadedModel, ModelConfig
from model_runner.paged_cache import BLOCK_SIZE, PagedKVCache
from model_runner.sampling import best_logits
from protos.types import ModelSpec
from serving.models import DEFAULT_MODEL


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="tokens already cached per sequence")
    parser.add_argument("--dtype", default="bfloat16,float32", help="dtypes to measure, the first is the headline")
    parser.add_argument("--runner", default="fast,hf", help="runners to measure (model_runner/loading.RUNNERS)")
    parser.add_argument("--layers", default="fused", help="the fast runner's decode step on the CPU: its layers in "
                        "one C++ call (fused), the same kernels called layer by layer from Python (python), or "
                        "both, measured in alternating rounds on one loaded model (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as a decode worker of `pdserve "
                        "cluster` gets on 2 cores (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per dtype (after 3 warm-up steps)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--random", default="", help="instead of --model, Llamas of these shapes with random weights "
                        f"made on the device, comma-separated: {', '.join(RANDOM_LLAMAS)} (fast runner only)")
    add_output_args(parser, "decode", plot=False)


# Shapes of public Llamas (Llama 3.2 1B, Llama 3.1 8B), for the GPU: SmolLM2-135M is too small to load one.
RANDOM_LLAMAS: dict[str, dict[str, Any]] = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},
}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    read_gbps = read_bandwidth(device)
    rates = {dtype: matmul_rate(DTYPES[dtype], device) for dtype in DTYPES}
    matmul_gflops = max(rates.values())
    variants = []
    models = [f"random:{name}" for name in args.random.split(",")] if args.random else [args.model]
    for model in models:
        for name in args.runner.split(",") if not args.random else ["fast"]:
            for dtype in args.dtype.split(","):
                if model.startswith("random:"):
                    runner = random_llama(model.removeprefix("random:"), dtype, device)
                else:
                    runner = ModelConfig(model=model, dtype=dtype, device=args.device, threads=args.threads,
                                         runner=name).load()
                # a GPU multiplies each dtype at its own rate; the CPU kernels multiply bfloat16 in float32
                rate = rates[dtype] if device.type == "cuda" else matmul_gflops
                variants += [{"model": model, "matmul_gflops": rate, **measured}
                             for measured in _measure_layers(runner, args, read_gbps, rate)]
                del runner
                print(f"bench decode: {model} {name} {dtype} done", file=sys.stderr, flush=True)
    head = variants[0]
    result = {"step_ms": head["step_ms"], "floor_ms": head["floor_ms"], "batch": args.batch, "context": args.context,
              "threads": args.threads, "device": _device_name(device), "read_gbps": read_gbps,
              "matmul_gflops": matmul_gflops, "matmul_gflops_by_dtype": rates, "variants": variants}
    return publish(args, "decode", result, lambda: _table(result))


CPU = torch.device("cpu")


def _greedy(logits: torch.Tensor) -> list[int]:
    """The tokens a decode worker's engine picks for greedy rows (engine/batch.py): model_runner/sampling's
    `best_logits`, one pass a row on the CPU."""
    return best_logits(logits)[1]


def read_bandwidth(device: torch.device = CPU, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s at which memory is read: on the CPU, the best of `repeats` sums over `nbytes` by this process's torch
    threads; on a GPU, a device-to-device copy of `nbytes`, counting the bytes read and written."""
    data = torch.ones(nbytes // 4, device=device)
    read: Callable[[], torch.Tensor]
    if device.type == "cpu":
        read, moved = lambda: data.sum(), nbytes
    else:
        target = torch.empty_like(data)
        read, moved = lambda: target.copy_(data), 2 * nbytes
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        _sync(device)
        started = time.perf_counter()
        read()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return moved / best / 1e9


def matmul_rate(dtype: torch.dtype, device: torch.device = CPU, repeats: int = 3) -> float:
    """GFLOP/s on an n x n matmul in `dtype` (n = 1536 on the CPU, 8192 on a GPU): the best of `repeats`, or of the
    first call alone if it took over a second (bfloat16 on a CPU without its instructions: ~1 GFLOP/s)."""
    n = 1536 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    _sync(device)
    started = time.perf_counter()
    torch.mm(a, b)  # also the warm-up: packing buffers, the kernel's first call
    _sync(device)
    best = time.perf_counter() - started
    for _ in range(repeats if best < 1 else 0):
        started = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best / 1e9


def random_llama(shape: str, dtype: str, device: torch.device) -> LoadedModel:
    """The fast runner over a Llama of one of RANDOM_LLAMAS' shapes, its weights drawn on the device (N(0, 0.02),
    as Hugging Face initialises them): no checkpoint to write or read."""
    from transformers import LlamaConfig

    from model_runner.llama import LlamaRunner

    config = LlamaConfig(max_position_embeddings=4096, **RANDOM_LLAMAS[shape])
    h, i, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    kv_heads: int = RANDOM_LLAMAS[shape]["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "self_attn.k_proj.weight": (kv_heads * d, h),
                   p + "self_attn.v_proj.weight": (kv_heads * d, h),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    generator = torch.Generator(device).manual_seed(0)
    weights = {name: (torch.ones(size, device=device) if len(size) == 1 else
                      torch.randn(size, device=device, generator=generator) * 0.02).to(DTYPES[dtype])
               for name, size in shapes.items()}
    spec = ModelSpec(name=f"random-{shape}", fingerprint=f"random-{shape}-{dtype}", dtype=dtype,
                     num_layers=config.num_hidden_layers, num_kv_heads=kv_heads, head_dim=d,
                     vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings, eos_token_ids=())
    fast = LlamaRunner(config, weights, DTYPES[dtype], device, spec.max_model_len)
    return LoadedModel(model=None, spec=spec, device=device, fast=fast)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


LAYERS = ("fused", "python")


def _measure_layers(runner: LoadedModel, args: argparse.Namespace, read_gbps: float,
                    matmul_gflops: float) -> list[dict[str, Any]]:
    """One variant per --layers choice the runner has. Where it has both, they take turns over two rounds on the
    same model (a noisy machine drifts between minutes, not between alternating rounds), each round's steps
    continuing the same sequences, and each keeps the median of its steps of both rounds; `same_tokens` says
    whether the two paths picked the same greedy tokens at every step (they run the same kernels in the same
    order)."""
    asked = args.layers.split(",")
    if unknown := set(asked) - set(LAYERS):
        raise SystemExit(f"bench decode: --layers {', '.join(sorted(unknown))}: expected some of {', '.join(LAYERS)}")
    fused = runner.fast._layer_weights if runner.fast is not None else None
    if fused is None or runner.device.type != "cpu":  # one path only: the reference runner, or not the CPU kernels
        alone = _measure(runner, args, read_gbps, matmul_gflops)
        del alone["tokens"]
        return [{"layers": "python" if runner.fast is not None else "", **alone}]
    runs: dict[str, list[dict[str, Any]]] = {layers: [] for layers in asked}
    try:
        for _ in range(2 if len(asked) > 1 else 1):
            for layers in asked:
                runner.fast._layer_weights = fused if layers == "fused" else None
                runs[layers].append(_measure(runner, args, read_gbps, matmul_gflops))
    finally:
        runner.fast._layer_weights = fused
    variants = []
    for layers, measured in runs.items():
        merged = measured[0] | {"layers": layers}
        merged["step_ms_samples"] = [t for run in measured for t in run["step_ms_samples"]]
        merged["step_ms"] = statistics.median(merged["step_ms_samples"])
        merged["step_over_floor"] = merged["step_ms"] / merged["floor_ms"]
        merged["step_over_compute_floor"] = merged["step_ms"] / merged["compute_floor_ms"]
        merged["tokens_per_s"] = args.batch / merged["step_ms"] * 1e3
        variants.append(merged)
    same = len({repr([run["tokens"] for run in measured]) for measured in runs.values()}) == 1
    for variant in variants:
        del variant["tokens"]
        if len(runs) > 1:
            variant["same_tokens"] = same
    return variants


def _measure(runner: LoadedModel, args: argparse.Namespace, read_gbps: float, matmul_gflops: float) -> dict[str, Any]:
    spec = runner.spec
    tokens_each = args.context + args.steps + 8
    cache = PagedKVCache(spec.num_layers, args.batch * -(-tokens_each // BLOCK_SIZE), spec.num_kv_heads, spec.head_dim,
                         runner.dtype, runner.device)
    generator = torch.Generator(runner.device).manual_seed(0)
    # a realistic cache: random values in every position the steps will read, each sequence's blocks shuffled
    # through the pool as they are after a while of joins and leaves
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator, device=runner.device))
    order = torch.randperm(cache.num_blocks, generator=generator, device=runner.device).tolist()
    per = cache.num_blocks // args.batch
    tables = [order[i * per : (i + 1) * per] for i in range(args.batch)]
    tokens = torch.randint(0, spec.vocab_size, (args.batch,), generator=generator, device=runner.device).tolist()
    times, picked = [], []
    for step in range(args.steps + 3):
        positions = [args.context + step] * args.batch
        started = time.perf_counter()
        logits = forward.decode_step(runner, cache, tokens, tables, positions)
        tokens = _greedy(logits)
        if step >= 3:
            times.append(time.perf_counter() - started)
        picked.append(tokens)
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
            "tokens_per_s": args.batch / step_ms * 1e3, "step_ms_samples": [t * 1e3 for t in times],
            "tokens": picked}


def _table(result: dict[str, Any]) -> str:
    lines = [f"Decode step on {result.get('device', 'cpu')} at batch {result['batch']}, {result['context']} cached "
             f"tokens each, {result['threads']} thread(s); read bandwidth {result['read_gbps']:.1f} GB/s, matmul "
             f"{result['matmul_gflops']:.0f} GFLOP/s",
             f"{'model':>16} {'runner':>6} {'layers':>6} {'dtype':>9} {'step ms':>8} {'floor ms':>9} "
             f"{'step/floor':>10} "
             f"{'compute floor':>13} {'step/compute':>12} {'tok/s':>7} {'weights MB':>10} {'KV MB':>6}"]
    for v in result["variants"]:
        model = Path(v.get("model", "")).name[-16:]
        lines.append(f"{model:>16} {v['runner']:>6} {v.get('layers', ''):>6} {v['dtype']:>9} {v['step_ms']:>8.2f} "
                     f"{v['floor_ms']:>9.2f} "
                     f"{v['step_over_floor']:>9.2f}x {v['compute_floor_ms']:>13.2f} "
                     f"{v['step_over_compute_floor']:>11.2f}x "
                     f"{v['tokens_per_s']:>7.1f} {v['weight_bytes'] / 1e6:>10.0f} {v['kv_bytes_per_step'] / 1e6:>6.0f}")
    return "\n".join(lines)
