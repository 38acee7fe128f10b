#!/usr/bin/env bash
# The same `specdecode serve` command from two versions of the code, alternating A B B A, each
# measured by this checkout's `specdecode bench-serve` (the same client for both). For "today's
# code against the code an issue was filed on" (issue 58's serving bar). Run it alone.
#   bash lab/probes/serve_ab.sh OUT_DIR OLD_CHECKOUT [ROUNDS]
# OLD_CHECKOUT: a worktree of the older commit (`git worktree add /tmp/old COMMIT`); it runs from
# its src/ with this Python. SERVE_ARGS, LEVELS (default 1,8), SECONDS_PER_LEVEL (40), TOKENS (96),
# BENCH_ARGS (default: six categories of short prompts; `--prompt-order continue` for the whole
# suite, prompts never seen). Two settings of one checkout side by side: OLD_CHECKOUT the same
# checkout, OLD_SERVE_ARGS the older setting's serve arguments (default SERVE_ARGS), NAMES the
# two labels (default "old new").
set -euo pipefail
out=${1:?output folder}
old=${2:?the older checkout}
rounds=${3:-1}
port=8766
target=qwen2.5-coder-1.5b-instruct:int4
draft=qwen2.5-coder-0.5b-instruct:int4
read -r -a serve_args <<<"${SERVE_ARGS:---target $target --draft $draft --k 4 --k-policy cost --max-batch 8}"
read -r -a old_serve_args <<<"${OLD_SERVE_ARGS:-${serve_args[*]}}"
read -r old_name new_name <<<"${NAMES:-old new}"
categories=chat,code_generation,creative_writing,question_answering,translation,math_reasoning
read -r -a bench_args <<<"${BENCH_ARGS:---categories $categories}"
mkdir -p "$out"

serve() {  # which (old/new), then the log file; sets pid
  if [[ $1 == old ]]; then
    PYTHONPATH="$old/src" python -c 'import sys; from specdecode.cli import main; sys.exit(main())' \
      serve --port "$port" --max-len 1024 "${old_serve_args[@]}" >"$2" 2>&1 &
  else
    specdecode serve --port "$port" --max-len 1024 "${serve_args[@]}" >"$2" 2>&1 &
  fi
  pid=$!
}

measure() {  # which, round
  local label
  if [[ $1 == old ]]; then label="$old_name-$2"; else label="$new_name-$2"; fi
  labels+=("$out/$label")
  serve "$1" "$out/$label.server.log"
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  specdecode bench-serve --endpoint "http://127.0.0.1:$port" --concurrency "${LEVELS:-1,8}" \
    --duration "${SECONDS_PER_LEVEL:-40}" --max-new-tokens "${TOKENS:-96}" --chat \
    "${bench_args[@]}" --label "$label" --out "$out/$label"
  kill "$pid"
  wait "$pid" || true
}

labels=()
for r in $(seq "$rounds"); do
  if ((r % 2)); then order="old new"; else order="new old"; fi
  for which in $order; do
    measure "$which" "$r"
  done
done
specdecode bench-serve --compare "${labels[@]}" --out "$out/compare"
