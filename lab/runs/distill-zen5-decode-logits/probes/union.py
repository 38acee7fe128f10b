"""Twice the prompts: the draft trained on the answers of both earlier runs at once.

runs/distill-big (480 prompts the target wrote from seed topics) and runs/distill-ex (480 it
wrote from the suite's training prompts as examples) share the suite's 16 training prompts and
every setting; their answers together are 2,922 (2 x 1,488, less the suite's 48 and 6 of two
prompts both runs wrote alike).
This trains LoRA on all of them exactly as `specdecode distill` would (the same settings,
train(), the same step order rule), for the budget given, and writes OUT/adapter and
OUT/distill.json (distill-ex's record, its training and data parts replaced), so that the
held-out probes and benchmarks/distill_gain.py read OUT like any distillation.

    PYTHONPATH=src python lab/runs/distill-zen5-decode-logits/probes/union.py \
        runs/distill-big runs/distill-ex 30m runs/union
"""

import json
import sys
import time
from pathlib import Path

import torch

from specdecode.distill.data import AnswerStore
from specdecode.distill.result import write_result
from specdecode.distill.run import peak_memory
from specdecode.distill.settings import Budget, DistillSettings
from specdecode.distill.train import (
    Checkpoints,
    add_lora,
    answers_digest,
    autocast_dtype,
    train,
    training_record,
)
from specdecode.models.loading import load_model

first, second, budget, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
record = json.loads((Path(second) / "distill.json").read_text())
answers, seen = [], set()
for run in (first, second):
    data = Path(run) / "data"
    key = json.loads((data / "config.json").read_text())["settings"]
    store = AnswerStore(data, key)
    for answer in store.load(sorted(store.done())):
        # a key names the prompt's text, temperature and sample, and so the answer: the
        # suite's prompts (and a prompt both runs wrote alike) are answered once
        if answer.key in seen:
            continue
        seen.add(answer.key)
        answer.key = f"{Path(run).name}/{answer.key}"
        answers.append(answer)
tokens = sum(a.tokens for a in answers)
print(f"{len(answers)} answers, {tokens} answer tokens", flush=True)

s = record["settings"]
settings = DistillSettings(
    target=s["target"],
    draft=s["draft"],
    out=str(out),
    lora_rank=s["lora_rank"],
    lr=s["lr"],
    batch_size=s["batch_size"],
    seed=s["seed"],
    dtype=s["dtype"],
    budget=Budget.parse(budget),
)
device = torch.device("cpu")
vocab = record["vocab"]
draft = load_model(s["draft"].split(":")[0], dtype="float32", kernel="off", role="draft")
model = add_lora(draft.model, settings.lora_rank, settings.alpha, settings.seed)
dtype = autocast_dtype(settings, device)
key = {**settings.train_key(), "answers": answers_digest(answers), "vocab": vocab}
start = time.perf_counter()
state = train(model, answers, settings, vocab, device, Checkpoints(out / "checkpoints", key))
print(f"trained {state.step} steps, {state.tokens} tokens in {time.perf_counter() - start:.0f} s")
print(f"peak RSS {peak_memory(device)['rss_bytes'] / 1e9:.2f} GB", flush=True)
record["training"] = {"loss": settings.loss, **training_record(settings, state, device, dtype)}
record["data"]["answers"] = len(answers)
record["data"]["tokens"] = tokens
record["data"]["union_of"] = [first, second]
write_result(out, model, record)
