#!/usr/bin/env bash
# vLLM's own client (`vllm bench serve`, its random dataset) against a pdserve cluster or a running peer.
#   bench/vllm_bench_serve.sh OUT_DIR NAME [pdserve cluster flags...]   starts `pdserve cluster` on :8200, then runs
#   BASE_URL=http://127.0.0.1:8101 bench/vllm_bench_serve.sh OUT_DIR vllm   runs against a server already up
# Needs the peers' vLLM install (../shared/peers/setup.sh); pdserve itself never does. Workload from the environment:
# INPUT_LEN (1024), OUTPUT_LEN (128), PROMPTS (40), RATE (1 request/s, Poisson), SEED (0) of the random prompts:
# give each run against a server that stays up a seed of its own, or its prefix cache serves the repeats. Writes
# OUT_DIR/NAME.json (vLLM's result file), NAME.txt (its report) and, for pdserve, NAME.cluster.log (every
# service's log).
set -euo pipefail
out=${1:?usage: vllm_bench_serve.sh OUT_DIR NAME [cluster flags...]} name=${2:?NAME}
shift 2
PEERS=${PEERS:-$HOME/.cache/pdserve-peers}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cluster=""
if [ -z "${BASE_URL:-}" ]; then
  BASE_URL=http://127.0.0.1:8200
  "$here/.venv/bin/pdserve" cluster --http-port 8200 --gateway-arg=--served-model-name=smollm2 "$@" \
    > "$out/$name.cluster.log" 2>&1 &
  cluster=$!
  trap 'kill -INT $cluster 2>/dev/null; wait $cluster 2>/dev/null || true' EXIT
  for _ in $(seq 1 150); do curl -sf -o /dev/null "$BASE_URL/v1/models" && break; sleep 2; done
fi
"$PEERS/vllm-venv/bin/vllm" bench serve --backend openai --base-url "$BASE_URL" --model smollm2 \
  --tokenizer "$PEERS/smollm2-hf" --dataset-name random --random-input-len "${INPUT_LEN:-1024}" \
  --random-output-len "${OUTPUT_LEN:-128}" --num-prompts "${PROMPTS:-40}" --request-rate "${RATE:-1}" --ignore-eos \
  --seed "${SEED:-0}" \
  --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --save-result --result-dir "$out" \
  --result-filename "$name.json" > "$out/$name.txt" 2>&1
grep -A 30 "Serving Benchmark Result" "$out/$name.txt" | grep -v "^$"
if [ -n "$cluster" ]; then
  (cd "$here" && .venv/bin/python -m bench.placement_error "$out/$name.cluster.log")
fi
