"""The 4-bit target's KL divergence to the same weights in float32, with its residual stream in
bfloat16 (before) and float32 (now), on llama.cpp's windows of the compare text; ours bfloat16
and the 4-bit target on Hugging Face's forward beside them. Never in CI.

    python lab/probes/kl_residual.py 8 runs/kl-residual   # windows of 512, output folder
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks
from benchmarks import llamacpp_kld as kld_run
from benchmarks import llamacpp_kld_io as kio
from specdecode.bench.quality import summarize_tokens, token_quality
from specdecode.models.lean import VERIFY_TOKENS, LeanCache
from specdecode.models.loading import load_model

TARGET = "qwen2.5-coder-1.5b-instruct"


def hf(model, context, scored):
    ids = torch.tensor([list(context) + list(scored)])
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0]
    return torch.log_softmax(logits[-(len(scored) + 1) : -1].float(), -1)  # [T, V]


def lean(residual):
    def forward(model, context, scored):
        cache = LeanCache(model, fused_tokens=VERIFY_TOKENS, residual=residual)
        with torch.inference_mode():
            logits = cache.forward(torch.tensor(list(context) + list(scored)))
        return torch.log_softmax(logits[-(len(scored) + 1) : -1].float(), -1)

    return forward


def main() -> None:
    n_windows, out = int(sys.argv[1]), Path(sys.argv[2])
    started = time.time()
    args = argparse.Namespace(limit=3, calibration_prompts=2, max_new_tokens=64)
    bf16 = load_model(TARGET, role="target")
    text, _ = kld_run.reference_text(bf16, args)
    tokens = bf16.tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = kio.windows(tokens, 512, None)[:n_windows]
    print(f"text {len(text)} chars, {len(tokens)} tokens, {len(chunks)} windows", flush=True)
    log_probs: dict[str, list[torch.Tensor]] = {}

    def run(name, model, forward):
        log_probs[name] = [forward(model, c, s) for c, s in chunks]
        print(name, f"{time.time() - started:.0f} s", flush=True)

    run("ours bf16 (lean)", bf16.model, lean(None))
    del bf16
    exact = load_model(TARGET, dtype="float32", role="target")
    run("float32", exact.model, hf)
    del exact
    quantized = load_model(TARGET + ":int4", role="target")
    run("int4 HF forward (bf16 hidden)", quantized.model, hf)
    run("int4 lean, bf16 residual (before)", quantized.model, lean(None))
    run("int4 lean, float32 residual (after)", quantized.model, lean(torch.float32))
    results = {}
    for name, rows in log_probs.items():
        if name == "float32":
            continue
        parts = [
            token_quality(ref[:, : q.shape[1]], q[:, : ref.shape[1]], list(s), kio.LOG_PROB_FLOOR)
            for ref, q, (_, s) in zip(log_probs["float32"], rows, chunks, strict=True)
        ]
        results[name] = summarize_tokens(parts)
        print(f"{name:38s}", results[name])
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "windows": len(chunks),
        "n_ctx": 512,
        "minutes": (time.time() - started) / 60,
        "vs_float32": results,
    }
    (out / "kl_residual.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
