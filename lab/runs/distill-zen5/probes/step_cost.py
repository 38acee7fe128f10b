"""One training step's time and the process's peak memory: a step's 4 answers one at a time
(gradients accumulated, the earlier path) or in one right-padded forward (batch_loss); the
same 10 steps of runs/distill-big's answers, the 0.5B draft in float32 + LoRA 16, bf16 autocast."""

import json
import resource
import sys
import time
from pathlib import Path

import torch

from specdecode.distill.data import AnswerStore
from specdecode.distill.train import add_lora, answer_loss, batch_loss
from specdecode.models.loading import load_model

mode, out = sys.argv[1], "runs/distill-big"
rec = json.loads(Path(f"{out}/distill.json").read_text())
vocab = rec["vocab"]
key = json.loads(Path(f"{out}/data/config.json").read_text())["settings"]
store = AnswerStore(Path(out) / "data", key)
manifest = json.loads(Path(f"{out}/data/manifest.json").read_text())["shards"]
keys = [k for ks in manifest.values() for k in ks][::37][:40]
answers = store.load(keys)
m = add_lora(
    load_model("qwen2.5-coder-0.5b-instruct", dtype="float32", kernel="off", role="draft").model,
    16,
    32.0,
)
m.train()
cpu = torch.device("cpu")
dt = torch.bfloat16
times, toks = [], []
for s in range(10):
    batch = answers[4 * s : 4 * s + 4]
    n = sum(a.tokens for a in batch)
    t = time.perf_counter()
    if mode == "single":
        for a in batch:
            (answer_loss(m, a, vocab, "kl", cpu, dt) / n).backward()
    else:
        (batch_loss(m, batch, vocab, "kl", cpu, dt) / n).backward()
    times.append(time.perf_counter() - t)
    toks.append(n)
    m.zero_grad(set_to_none=True)
print(
    mode,
    "steps",
    [round(x, 2) for x in times],
    "answer tok/s (steps 2-10)",
    round(sum(toks[1:]) / sum(times[1:]), 1),
    "positions",
    sum(len(a.prompt_ids) + a.tokens for a in answers),
    "peak RSS GB",
    round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
)
