"""Two data folders' answers, key by key: the same answers, and how close their kept
distributions are (runs/distill-ex: a scoring forward per answer; runs/distill-ex2: the same
prompts and command, the distributions kept from the decoding forwards).

    PYTHONPATH=src python lab/runs/distill-zen5-decode-logits/probes/compare_data.py \
        runs/distill-ex runs/distill-ex2
"""

import json
import sys
from pathlib import Path

import torch

from specdecode.distill.data import AnswerStore


def store(run: str) -> AnswerStore:
    data = Path(run) / "data"
    return AnswerStore(data, json.loads((data / "config.json").read_text())["settings"])


a, b = store(sys.argv[1]), store(sys.argv[2])
keys = sorted(a.done())
print(f"answers: {len(keys)} and {len(b.done())}; the same keys: {set(keys) == b.done()}")
same_answer = same_top = n = 0
worst = tail = 0.0
for x, y in zip(a.load(keys), b.load(keys), strict=True):
    if not torch.equal(x.answer_ids, y.answer_ids):
        continue
    same_answer += 1
    n += len(x.answer_ids)
    same_top += int(torch.equal(x.top_ids, y.top_ids))
    worst = max(worst, float((x.top_logprobs.float() - y.top_logprobs.float()).abs().max()))
    tail += float((x.tail - y.tail).abs().sum())
print(f"the same answer ids: {same_answer}; the same top-k ids in the same order: {same_top}")
print(f"over their {n} positions: largest |diff| of a top log-prob {worst:.4f}")
print(f"mean |diff| of the tail mass {tail / n:.2e}")
