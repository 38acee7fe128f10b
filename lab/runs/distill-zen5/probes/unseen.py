"""Top-1 agreement and KL of the base and distilled drafts on the training answers the 25-minute
budget never reached (unseen), and on some it trained on (seen), float32, no kernel."""

import json
import sys
from pathlib import Path

import torch

from specdecode.distill.data import AnswerStore, plan_answers
from specdecode.distill.loss import distill_loss
from specdecode.distill.prompts import cached_self_prompts, suite_prompts
from specdecode.distill.settings import Budget, DistillSettings
from specdecode.distill.train import step_indices
from specdecode.models.loading import load_model

out = sys.argv[1]
rec = json.loads(Path(f"{out}/distill.json").read_text())
key = json.loads(Path(f"{out}/data/config.json").read_text())["settings"]
store = AnswerStore(__import__("pathlib").Path(out) / "data", key)

keys = sorted(store.done())
# the run's answer order: run_distill loads answers in planned order; rebuild it from manifest order
manifest = json.loads(Path(f"{out}/data/manifest.json").read_text())["shards"]
order = [k for ks in manifest.values() for k in ks]
answers_keys = order  # planned order may differ; recover via record below
steps = rec["training"]["steps"]
bs = rec["settings"]["batch_size"]
seed = rec["settings"]["seed"]
vocab = rec["vocab"]
# planned order = prompts order x temps; reproduce with run's own code

s = rec["settings"]
s = {**s, "budget": Budget.parse(s["budget"])}
settings = DistillSettings(**s)

train_prompts, _ = suite_prompts(settings.prompts, settings.categories, settings.holdout)
cats = list(dict.fromkeys(p.category for p in train_prompts))
written = cached_self_prompts(store.dir, cats, settings.self_prompts)
planned = plan_answers(train_prompts + written, settings.temperatures, settings.samples)
n = len(planned)
seen_idx = set()
for st in range(steps):
    seen_idx.update(step_indices(st, n, bs, seed))
unseen = [i for i in range(n) if i not in seen_idx]
print("answers", n, "seen", len(seen_idx), "unseen", len(unseen))
pick_unseen = [planned[i].key for i in unseen]
pick_seen = [planned[i].key for i in sorted(seen_idx)[:: max(1, len(seen_idx) // len(unseen))]][
    : len(unseen)
]
for name, adapter in (("base", None), ("distilled", out)):
    m = load_model(
        settings.draft.split(":")[0], dtype="float32", kernel="off", role="draft", adapter=adapter
    ).model
    for label, ks in (("unseen", pick_unseen), ("seen", pick_seen)):
        agree = tot = 0
        kl = 0.0
        per = {}
        for a in store.load(ks):
            with torch.no_grad():
                ids = torch.cat([a.prompt_ids, a.answer_ids[:-1]]).long()[None]
                lg = m(input_ids=ids, logits_to_keep=a.tokens).logits[0, :, :vocab].float()
                kl += float(distill_loss(lg, a.top_logprobs, a.top_ids, a.tail, "kl").sum())
                hit = lg.argmax(-1) == a.top_ids[:, 0].long()
                agree += int(hit.sum())
                tot += a.tokens
                c = per.setdefault(a.category, [0, 0])
                c[0] += int(hit.sum())
                c[1] += a.tokens
        print(
            name,
            label,
            "tokens",
            tot,
            "top1",
            round(agree / tot, 4),
            "kl/token",
            round(kl / tot, 4),
            {c: round(v[0] / v[1], 3) for c, v in per.items()},
            flush=True,
        )
