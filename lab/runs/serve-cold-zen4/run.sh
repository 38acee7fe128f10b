#!/usr/bin/env bash
# ours and llama-server, levels 1,8, --prompt-order continue over the whole suite (72 prompts)
set -euo pipefail
out=/tmp/ttft/cold; mkdir -p $out; port=8767
bench() { specdecode bench-serve --endpoint http://127.0.0.1:$port --concurrency 1,8 --duration 40 --max-new-tokens 96 --chat --prompt-order continue --label $1 --out $out/$1 > $out/$1.bench.log 2>&1; curl -s http://127.0.0.1:$port/metrics > $out/$1.metrics.txt || true; }
wait_up() { for _ in $(seq 600); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done; }
specdecode serve --port $port --max-len 1024 --target qwen2.5-coder-1.5b-instruct:int4 --draft qwen2.5-coder-0.5b-instruct:int4 --k 4 --k-policy cost --max-batch 8 > $out/ours.server.log 2>&1 &
pid=$!; wait_up; bench ours; grep VmHWM /proc/$pid/status > $out/ours.peak_rss; kill $pid; wait $pid || true
/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server -m ~/.cache/specdecode/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 --parallel 8 -c 8192 --port $port --jinja > $out/llamacpp.server.log 2>&1 &
pid=$!; wait_up; bench llamacpp; grep VmHWM /proc/$pid/status > $out/llamacpp.peak_rss; kill $pid; wait $pid || true
specdecode bench-serve --compare $out/ours $out/llamacpp --out $out/compare > /dev/null 2>&1
