"""The data phase's answers made two ways, side by side in one process on the real pair:

- `score`: the answers by batched decoding, then one teacher-forced scoring forward of the
  target over each prompt + answer for its distributions (the data phase before this change);
- `keep`: the distributions kept from the decoding forwards themselves (`on_logits`).

The suite's prompts of the four low-acceptance categories, greedy and once at T = 0.7, 96 new
tokens, 8 rows, chat template; after a warm-up, the two alternate (keep, score, keep, score).
Prints seconds and answer tokens/s per round, and how far the kept distributions are from the
scored ones on the same answers (top-1 id agreement, largest |difference| of the top log-probs,
mean |difference| of the tail mass).

    PYTHONPATH=src python lab/runs/distill-zen5-decode-logits/probes/data_rate.py
"""

import time

import torch

from specdecode import SpeculativeDecoder
from specdecode.bench.quality import answer_log_probs
from specdecode.bench.suites import load_suite
from specdecode.distill.data import generate_each, top_distributions
from specdecode.models.loading import load_model
from specdecode.request import GenerationRequest

CATEGORIES = ("chat", "creative_writing", "translation", "question_answering")
TOP_K, ROWS, NEW = 32, 8, 96

target = load_model("qwen2.5-coder-1.5b-instruct:int4", dtype="bfloat16", role="target")
engine = SpeculativeDecoder(target, None, generation_config="none")
vocab = target.model.config.vocab_size
prompts = [p.turns[0] for p in load_suite(None) if p.category in CATEGORIES]
jobs = [
    (
        engine.encode_prompt(text, chat=True),
        GenerationRequest(NEW, engine.sampling_params(temperature=t), seed=i),
    )
    for i, text in enumerate(prompts)
    for t in (0.0, 0.7)
]


def run(mode: str, chosen) -> tuple[float, int, dict]:
    kept: dict[int, list] = {}

    def keep(index, logits):
        kept.setdefault(index, []).append(top_distributions(logits, vocab, TOP_K))

    start = time.perf_counter()
    out, tokens = {}, 0
    hook = keep if mode == "keep" else None
    for index, result in generate_each(engine, chosen, ROWS, on_logits=hook):
        answer = list(result.token_ids)
        if mode == "keep":
            parts = zip(*kept.pop(index), strict=True)
            dist = tuple(torch.cat(part)[: len(answer)] for part in parts)
        else:
            scored = answer_log_probs(target.model, chosen[index][0], answer)
            dist = top_distributions(scored, vocab, TOP_K)
        out[index] = (answer, dist)
        tokens += len(answer)
    return time.perf_counter() - start, tokens, out


run("keep", jobs[:8])  # warm-up: kernels, the store
print(f"{len(jobs)} answers ({len(prompts)} prompts x greedy + T=0.7), {NEW} tokens, {ROWS} rows")
results = {}
for mode in ("keep", "score", "keep", "score"):
    seconds, tokens, out = run(mode, jobs)
    results[mode] = out
    print(f"{mode:5s} {seconds:7.1f} s  {tokens} tokens  {tokens / seconds:6.1f} answer tokens/s")

same = agree = n = 0
worst, tail_diff = 0.0, 0.0
for index, (answer, (values, ids, tail)) in results["keep"].items():
    answer2, (values2, ids2, tail2) = results["score"][index]
    if answer != answer2:
        continue
    same += 1
    n += len(answer)
    agree += int((ids[:, 0] == ids2[:, 0]).sum())
    both = ids.long().unsqueeze(-1) == ids2.long().unsqueeze(-2)  # [T, K, K]
    diff = (values.float().unsqueeze(-1) - values2.float().unsqueeze(-2)).abs()
    worst = max(worst, float(diff[both].max()))
    tail_diff += float((tail - tail2).abs().sum())
print(f"same answers both ways: {same} of {len(jobs)}; over their {n} positions:")
print(f"top-1 id agreement {agree / n:.4f}; largest |diff| of a top log-prob {worst:.4f}")
print(f"mean |diff| of the tail mass {tail_diff / n:.5f}")
