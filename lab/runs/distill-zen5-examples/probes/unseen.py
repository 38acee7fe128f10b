"""Top-1 agreement and KL of the base and distilled drafts, teacher-forced (float32, no kernel),
on training answers the budget never reached and on as many it trained on; per category."""

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

out = Path(sys.argv[1])
rec = json.loads((out / "distill.json").read_text())
settings = DistillSettings(**{**rec["settings"], "budget": Budget.parse(rec["settings"]["budget"])})
store = AnswerStore(out / "data", json.loads((out / "data/config.json").read_text())["settings"])
train_prompts, _ = suite_prompts(settings.prompts, settings.categories, settings.holdout)
written = cached_self_prompts(store.dir, train_prompts, settings.self_prompts)
planned = plan_answers(train_prompts + written, settings.temperatures, settings.samples)
n, steps = len(planned), rec["training"]["steps"]
seen = sorted(
    {i for s in range(steps) for i in step_indices(s, n, settings.batch_size, settings.seed)}
)
trained = set(seen)
never = [i for i in range(n) if i not in trained]
unseen = never[:: max(1, len(never) // 160)][:160]  # spread over the categories
picked = {"unseen": unseen, "seen": seen[:: max(1, len(seen) // len(unseen))][: len(unseen)]}
print("answers", n, "trained on", len(seen), "never reached", n - len(seen), flush=True)
vocab = rec["vocab"]
for name, adapter in (("base", None), ("distilled", str(out))):
    m = load_model(
        settings.draft.split(":")[0], dtype="float32", kernel="off", role="draft", adapter=adapter
    ).model
    for label, indices in picked.items():
        agree = tot = 0
        kl = 0.0
        per: dict[str, list[int]] = {}
        for a in store.load([planned[i].key for i in indices]):
            with torch.no_grad():
                ids = torch.cat([a.prompt_ids, a.answer_ids[:-1]]).long()[None]
                lg = m(input_ids=ids, logits_to_keep=a.tokens).logits[0, :, :vocab].float()
                kl += float(distill_loss(lg, a.top_logprobs, a.top_ids, a.tail, "kl").sum())
                hit = int((lg.argmax(-1) == a.top_ids[:, 0].long()).sum())
            agree, tot = agree + hit, tot + a.tokens
            c = per.setdefault(a.category, [0, 0])
            c[0], c[1] = c[0] + hit, c[1] + a.tokens
        top1 = {c: round(v[0] / v[1], 3) for c, v in per.items()}
        print(name, label, "answers", len(indices), "tokens", tot, "top1", round(agree / tot, 3),
              "kl/token", round(kl / tot, 3), top1, flush=True)  # fmt: skip
