#!/usr/bin/env bash
# Continuous batching on the real pair, through the server (issue 25; lab/benchmarks.md):
# the same server at --max-batch 1 and 8, with and without speculation, each measured by
# `specdecode bench-serve` at concurrency 1, 2, 4, 8, one configuration after the other.
# Run it alone (2 cores: a parallel job corrupts the timings). Usage:
#   bash lab/probes/serve_batching.sh OUT_DIR [MAX_NEW_TOKENS]
# With LLAMACPP_BIN=DIR (llama.cpp's tools, lab/benchmarks.md) it also measures our server on
# the 4-bit target and llama.cpp's own llama-server on the same Q4_K_M file (8 slots), the peer.
# CONFIGS="int4-batch8-cost int4-batch8-ar llamacpp-server" runs only those (see configure).
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
  specdecode serve --port "$port" --max-len 1024 "$@" >"$out/$label.server.log" 2>&1 &
  measure "$label" $!
}

measure() {  # label, the server's pid
  local label=$1 pid=$2
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  specdecode bench-serve --endpoint "http://127.0.0.1:$port" --concurrency 1,2,4,8 \
    --duration "${SECONDS_PER_LEVEL:-40}" --max-new-tokens "$tokens" --chat \
    ${CATEGORIES:+--categories "$CATEGORIES"} \
    --label "$label" --out "$out/$label"
  curl -s "http://127.0.0.1:$port/metrics" >"$out/$label.metrics.txt"
  grep VmHWM "/proc/$pid/status" >"$out/$label.peak_rss"  # the server's peak RSS
  kill "$pid"
  wait "$pid" || true
}

configure() {  # label -> the server it measures
  local gguf=~/.cache/specdecode/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
  case $1 in
    batch1-cost) run "$1" --target "$target" --draft "$draft" --k 4 --k-policy cost --max-batch 1 ;;
    batch8-cost) run "$1" --target "$target" --draft "$draft" --k 4 --k-policy cost --max-batch 8 ;;
    batch8-ar) run "$1" --target "$target" --max-batch 8 ;;
    batch8-k3) run "$1" --target "$target" --draft "$draft" --k 3 --max-batch 8 ;;
    int4-batch8-cost)
      run "$1" --target "$target:int4" --draft "$draft" --k 4 --k-policy cost --max-batch 8 ;;
    int4-batch8-ar) run "$1" --target "$target:int4" --max-batch 8 ;;
    llamacpp-server)  # 8 slots of 1024 positions, as ours; the chat template from the file
      "${LLAMACPP_BIN:?llamacpp-server needs LLAMACPP_BIN}/llama-server" -m "$gguf" -t 2 \
        --parallel 8 -c 8192 --port "$port" --jinja >"$out/$1.server.log" 2>&1 &
      measure "$1" $! ;;
    *) echo "unknown configuration $1" >&2; exit 2 ;;
  esac
}

# CONFIGS="a b ..." picks configurations (in that order); by default the four on the bfloat16
# target, and with LLAMACPP_BIN the 4-bit target's and llama.cpp's server too
default="batch1-cost batch8-cost batch8-ar batch8-k3"
[[ -n "${LLAMACPP_BIN:-}" ]] && default+=" int4-batch8-cost llamacpp-server"
read -r -a runs <<<"${CONFIGS:-$default}"
for label in "${runs[@]}"; do
  configure "$label"
done
specdecode bench-serve --compare "${runs[@]/#/$out/}" --out "$out/compare"
