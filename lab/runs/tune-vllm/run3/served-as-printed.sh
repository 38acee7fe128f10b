#!/bin/bash
cd /tmp
PATH=/work/vllm-venv/bin:$PATH
python -m vllm.entrypoints.openai.api_server --model /root/.cache/specdecode/qwen2.5-coder-1.5b-instruct --served-model-name target --host 127.0.0.1 --port 8000 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}' --dtype bfloat16 --max-model-len 4096
