"""Top-1 agreement and KL of the base and distilled drafts on the target's own greedy (and T=0.7)
answers to the held-out suite prompts, teacher-forced, float32 drafts."""

import json
import sys
from pathlib import Path

import torch

from specdecode import SpeculativeDecoder
from specdecode.bench.quality import answer_log_probs
from specdecode.bench.suites import load_suite
from specdecode.distill.data import generate_each, top_distributions
from specdecode.distill.loss import distill_loss
from specdecode.models.loading import load_model
from specdecode.request import GenerationRequest
from specdecode.sampling import SamplingParams

out = sys.argv[1]
rec = json.loads(Path(f"{out}/distill.json").read_text())
vocab = rec["vocab"]
held = set(rec["data"]["heldout_prompt_ids"])
prompts = [p for p in load_suite(None) if p.id in held]
t = load_model(
    rec["target"].split("/")[-1] if "/" in rec["target"] else rec["target"],
    dtype="bfloat16",
    role="target",
)
eng = SpeculativeDecoder(t, None, generation_config="none")
if len(sys.argv) > 2 and sys.argv[2] == "self":  # new target-written prompts, seeds never used
    from types import SimpleNamespace

    from specdecode.distill.prompts import SEED_TOPICS, SELF_TEMPERATURE, SELF_TOP_P, _instruction

    cats = ["chat", "creative_writing", "translation", "question_answering"]
    wjobs = []
    for c in cats:
        ask, topics = SEED_TOPICS[c]
        for i in range(10):
            wjobs.append(
                (
                    c,
                    eng.encode_prompt(_instruction(ask, topics, i), chat=True),
                    GenerationRequest(
                        96, SamplingParams(SELF_TEMPERATURE, top_p=SELF_TOP_P), seed=100_000 + i
                    ),
                )
            )
    written = dict(generate_each(eng, [(j[1], j[2]) for j in wjobs], 8))
    prompts = [
        SimpleNamespace(category=wjobs[i][0], turns=[written[i].text.strip()])
        for i in range(len(wjobs))
    ]
    print("new self-written prompts", len(prompts), repr(prompts[5].turns[0][:80]))
jobs = []
for p in prompts:
    ids = eng.encode_prompt(p.turns[0], chat=True)
    for temp, seed in ((0.0, 0), (0.7, 1), (0.7, 2)):
        jobs.append((ids, GenerationRequest(96, SamplingParams(temperature=temp), seed=seed)))
data = []
for i, r in generate_each(eng, jobs, 8):
    ids = jobs[i][0]
    ans = list(r.token_ids)
    # the scoring forward over prompt + answer (the data phase's before commit 9bc39b9;
    # the decoding forwards give the same bits since: ../../distill-zen5-decode-logits)
    v, tid, tail = top_distributions(answer_log_probs(t.model, ids, ans), vocab, 32)
    data.append((prompts[i // 3].category, jobs[i][1].params.temperature, ids, ans, v, tid, tail))
del eng, t
print("answers", len(data), "tokens", sum(len(d[3]) for d in data), flush=True)
for name, adapter in (("base", None), ("distilled", out)):
    m = load_model(
        rec["settings"]["draft"].split(":")[0],
        dtype="float32",
        kernel="off",
        role="draft",
        adapter=adapter,
    ).model
    res = {}
    for cat, temp, ids, ans, v, tid, tail in data:
        with torch.no_grad():
            x = torch.tensor(ids + ans[:-1])[None]
            lg = m(input_ids=x, logits_to_keep=len(ans)).logits[0, :, :vocab].float()
            kl = float(distill_loss(lg, v, tid, tail, "kl").sum())
            hit = int((lg.argmax(-1) == tid[:, 0].long()).sum())
        for k in (("all", temp), (cat, temp)):
            r = res.setdefault(k, [0, 0, 0.0])
            r[0] += hit
            r[1] += len(ans)
            r[2] += kl
    for k, r in sorted(res.items()):
        print(
            name,
            k,
            "tokens",
            r[1],
            "top1",
            round(r[0] / r[1], 3),
            "kl/token",
            round(r[2] / r[1], 3),
            flush=True,
        )
