#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (CI has none, so they skip there):
#   1. the tests marked gpu: tests/test_cuda.py and the KV wire's (device -> pinned host -> wire -> device);
#   2. `pdserve bench decode --device cuda` on random Llamas of Llama 3.2 1B's and Llama 3.1 8B's shapes, at
#      batch 1, 8 and 64, with CUDA graphs, and at batch 8 without them (PDSERVE_CUDA_GRAPHS=0);
#   3. bench/gpu_probes.py: how far a row's logits move between running alone and in a batch of 8 on the GPU
#      (batch invariance), and a profile of one eager step.
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

"$py" -m bench.gpu_probes invariance 2>&1 | tee "$out/invariance.txt"
"$py" -m bench.gpu_probes profile 2>&1 | tee "$out/profile.txt" | tail -n 25
