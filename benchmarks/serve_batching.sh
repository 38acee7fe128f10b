#!/usr/bin/env bash
# Continuous batching on the real pair, through the server (issue 25; docs/benchmarks.md):
# the same server at --max-batch 1 and 8, with and without speculation, each measured by
# `specdecode bench-serve` at concurrency 1, 2, 4, 8, one configuration after the other.
# Run it alone (2 cores: a parallel job corrupts the timings). Usage:
#   bash benchmarks/serve_batching.sh OUT_DIR [MAX_NEW_TOKENS]
set -euo pipefail
out=${1:?output folder}
tokens=${2:-48}
target=qwen2.5-coder-1.5b-instruct
draft=qwen2.5-coder-0.5b-instruct:int4
port=8765
mkdir -p "$out"

run() {  # label, then serve's options
  local label=$1
  shift
  specdecode serve --target "$target" --port "$port" --max-len 1024 "$@" \
    >"$out/$label.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  specdecode bench-serve --endpoint "http://127.0.0.1:$port" --concurrency 1,2,4,8 \
    --duration "${SECONDS_PER_LEVEL:-40}" --max-new-tokens "$tokens" --chat \
    --label "$label" --out "$out/$label"
  curl -s "http://127.0.0.1:$port/metrics" >"$out/$label.metrics.txt"
  grep VmHWM "/proc/$pid/status" >"$out/$label.peak_rss"  # the server's peak RSS
  kill "$pid"
  wait "$pid" || true
}

run batch1-cost --draft "$draft" --k 4 --k-policy cost --max-batch 1
run batch8-cost --draft "$draft" --k 4 --k-policy cost --max-batch 8
run batch8-ar --max-batch 8
run batch8-k3 --draft "$draft" --k 3 --max-batch 8
specdecode bench-serve --compare "$out"/batch1-cost "$out"/batch8-cost "$out"/batch8-ar \
  "$out"/batch8-k3 --out "$out/compare"
