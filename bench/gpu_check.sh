#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (CI has none, so they skip there):
#   1. the tests marked gpu: tests/test_cuda.py and the KV wire's (device -> pinned host -> wire -> device);
#   2. `pdserve bench decode --device cuda` on random Llamas of Llama 3.2 1B's and Llama 3.1 8B's shapes, at
#      batch 1, 8 and 64, with CUDA graphs, and at batch 8 without them (PDSERVE_CUDA_GRAPHS=0);
#   3. how far a row's logits move between running alone and in a batch of 8 on the GPU (batch invariance).
# Usage: bench/gpu_check.sh [OUT]   (results and logs go to OUT, default bench/results/gpu; PY picks the python)
set -uo pipefail
out=${1:-bench/results/gpu}
py=${PY:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

"$py" -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_cuda.py tests/test_kv_wire.py 2>&1 \
    | tee "$out/tests.log" | tail -n 30

for batch in 1 8 64; do
    "$py" -m pdserve.cli bench decode --device cuda --random llama-1b,llama-8b --dtype bfloat16,float32 \
        --batch "$batch" --context 512 --steps 50 --out "$out/decode-b$batch" 2>&1 | grep -v "^bench decode:"
done
PDSERVE_CUDA_GRAPHS=0 "$py" -m pdserve.cli bench decode --device cuda --random llama-1b,llama-8b \
    --dtype bfloat16,float32 --batch 8 --context 512 --steps 50 --out "$out/decode-b8-eager" 2>&1 \
    | grep -v "^bench decode:"

"$py" - <<'EOF' 2>&1 | tee "$out/invariance.txt"
# A row's logits alone and in a batch of 8, same cache, CUDA graphs as served: cuBLAS picks its GEMM kernels by
# the batch's size, so the bits may differ; this measures by how much.
import torch
from bench.decode import random_llama
from model_runner import forward
from model_runner.paged_cache import PagedKVCache

for dtype in ("bfloat16", "float32"):
    runner = random_llama("llama-1b", dtype, torch.device("cuda"))
    spec = runner.spec
    cache = PagedKVCache(spec.num_layers, 8 * 33, spec.num_kv_heads, spec.head_dim, runner.dtype, runner.device)
    cache.kv.normal_()
    tables = [list(range(i * 33, (i + 1) * 33)) for i in range(8)]
    ids = list(range(100, 108))
    batched = forward.decode_step(runner, cache, ids, tables, [512] * 8).clone()
    alone = forward.decode_step(runner, cache, ids[:1], tables[:1], [512]).clone()
    delta = (batched[0].float() - alone[0].float()).abs().max().item()
    same = torch.equal(batched[0], alone[0])
    print(f"{dtype}: row 0 alone vs in a batch of 8: bit-identical {same}, max |logit difference| {delta:.3g}, "
          f"argmax {int(alone[0].argmax())} vs {int(batched[0].argmax())}")
EOF

"$py" - <<'EOF2' 2>&1 | tee "$out/profile.txt" | tail -n 25
# Where a step's time goes: one eager step (no graph) of the 1B shape at batch 8, bfloat16, under the profiler;
# kernels by device time, and how many launches a step makes.
import torch
from torch.profiler import ProfilerActivity, profile

from bench.decode import random_llama
from model_runner import forward
from model_runner.paged_cache import PagedKVCache

runner = random_llama("llama-1b", "bfloat16", torch.device("cuda"))
runner.fast.graphs = None
spec = runner.spec
cache = PagedKVCache(spec.num_layers, 8 * 33, spec.num_kv_heads, spec.head_dim, runner.dtype, runner.device)
cache.kv.normal_()
tables = [list(range(i * 33, (i + 1) * 33)) for i in range(8)]
for _ in range(3):
    forward.decode_step(runner, cache, list(range(8)), tables, [512] * 8)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    forward.decode_step(runner, cache, list(range(8)), tables, [512] * 8).argmax(-1).tolist()
kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
print(f"kernels per eager step: {len(kernels)}, device time {sum(e.device_time for e in kernels) / 1e3:.3f} ms")
by_name = {}
for e in kernels:
    count, total = by_name.get(e.name, (0, 0.0))
    by_name[e.name] = (count + 1, total + e.device_time)
for name, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:20]:
    print(f"{total / 1e3:8.3f} ms {count:5d}x  {name[:110]}")
EOF2
