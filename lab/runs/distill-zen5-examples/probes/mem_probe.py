"""RSS over training steps: the run's step order over runs/distill-big's answers, the 0.5B draft
float32 + LoRA 16, bf16 autocast, AdamW; prints the current and peak RSS every 10 steps."""

import json
import resource
import sys
import time
from pathlib import Path

import torch

from specdecode.distill.data import AnswerStore
from specdecode.distill.train import add_lora, batch_loss, step_indices
from specdecode.models.loading import load_model

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
out = sys.argv[2] if len(sys.argv) > 2 else "runs/distill-big"
rec = json.loads(Path(f"{out}/distill.json").read_text())
vocab = rec["vocab"]
key = json.loads(Path(f"{out}/data/config.json").read_text())["settings"]
store = AnswerStore(Path(out) / "data", key)
manifest = json.loads(Path(f"{out}/data/manifest.json").read_text())["shards"]
answers = store.load([k for ks in manifest.values() for k in ks])
m = add_lora(
    load_model("qwen2.5-coder-0.5b-instruct", dtype="float32", kernel="off", role="draft").model,
    16,
    32.0,
)
m.train()
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=2e-4)
cpu, dt = torch.device("cpu"), torch.bfloat16


def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1e6
    return 0.0


print("loaded", len(answers), "answers; RSS GB", round(rss(), 2), flush=True)
t0, toks = time.perf_counter(), 0
for s in range(steps):
    batch = [answers[i] for i in step_indices(s, len(answers), 4, 0)]
    n = sum(a.tokens for a in batch)
    opt.zero_grad(set_to_none=True)
    (batch_loss(m, batch, vocab, "kl", cpu, dt) / n).backward()
    opt.step()
    toks += n
    if (s + 1) % 10 == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print(
            f"step {s + 1} RSS {rss():.2f} peak {peak:.2f} GB, {toks / (time.perf_counter() - t0):.1f} tok/s",
            flush=True,
        )
