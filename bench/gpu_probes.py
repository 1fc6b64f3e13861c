"""`python -m bench.gpu_probes invariance|profile`: two measurements bench/gpu_check.sh makes on a CUDA device.

- invariance: a row's logits alone and in a batch of 8, same cache, CUDA graphs as served. cuBLAS picks its GEMM
  kernels by the batch's size, so the bits may differ; this measures by how much.
- profile: where a step's time goes: one eager step (no graph) of the 1B shape at batch 8, bfloat16, under the
  profiler; kernels by device time, and how many launches a step makes.
"""

from __future__ import annotations

import sys

import torch

from bench.decode import random_llama
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.paged_cache import PagedKVCache

BATCH, BLOCKS_EACH, CONTEXT = 8, 33, 512  # 33 blocks of 16 hold the 512 cached tokens and the new one


def _setup(dtype: str) -> tuple[LoadedModel, PagedKVCache, list[list[int]]]:
    """The 1B shape on the GPU, a cache of random keys and values, and BATCH sequences' block tables."""
    runner = random_llama("llama-1b", dtype, torch.device("cuda"))
    spec = runner.spec
    cache = PagedKVCache(spec.num_layers, BATCH * BLOCKS_EACH, spec.num_kv_heads, spec.head_dim, runner.dtype,
                         runner.device)
    cache.kv.normal_()
    tables = [list(range(i * BLOCKS_EACH, (i + 1) * BLOCKS_EACH)) for i in range(BATCH)]
    return runner, cache, tables


def invariance() -> None:
    for dtype in ("bfloat16", "float32"):
        runner, cache, tables = _setup(dtype)
        ids = list(range(100, 100 + BATCH))
        batched = forward.decode_step(runner, cache, ids, tables, [CONTEXT] * BATCH).clone()
        alone = forward.decode_step(runner, cache, ids[:1], tables[:1], [CONTEXT]).clone()
        delta = (batched[0].float() - alone[0].float()).abs().max().item()
        same = torch.equal(batched[0], alone[0])
        print(f"{dtype}: row 0 alone vs in a batch of {BATCH}: bit-identical {same}, max |logit difference| "
              f"{delta:.3g}, argmax {int(alone[0].argmax())} vs {int(batched[0].argmax())}")


def profile() -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner, cache, tables = _setup("bfloat16")
    runner.fast.graphs = None
    ids = list(range(BATCH))
    for _ in range(3):
        forward.decode_step(runner, cache, ids, tables, [CONTEXT] * BATCH)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward.decode_step(runner, cache, ids, tables, [CONTEXT] * BATCH).argmax(-1).tolist()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"kernels per eager step: {len(kernels)}, device time {sum(e.device_time for e in kernels) / 1e3:.3f} ms")
    by_name: dict[str, tuple[int, float]] = {}
    for e in kernels:
        count, total = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (count + 1, total + e.device_time)
    for name, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:20]:
        print(f"{total / 1e3:8.3f} ms {count:5d}x  {name[:110]}")


if __name__ == "__main__":
    {"invariance": invariance, "profile": profile}[sys.argv[1]]()
