"""The data phase's answer rate on this CPU by the target's weights and rows, in one process:
the target on 4-bit weights (`int4`: our kernel), on bfloat16 ones through our kernel (`bf16`:
its bfloat16 panels, AVX-512 BF16 dot products here) or through PyTorch (`bf16-torch`: kernel
off, Hugging Face's forward, PyTorch's matrix products, which use AMX where the CPU has it), 8 to 64 rows of batched decoding, the distributions kept from the
decoding forwards (`on_logits`), as `specdecode distill`'s data phase makes them.

The suite's prompts of the four low-acceptance categories, greedy and $SAMPLES times (2) at
T = 0.7 (96 jobs), 96 new tokens, chat template; a short warm-up per configuration. Prints seconds and answer
tokens/s per configuration, and whether each configuration's greedy answers equal the first's.

    PYTHONPATH=src python lab/runs/distill-amx/probes/data_rate.py int4:8 bf16:8 bf16:32
    SAMPLES=7 PYTHONPATH=src python lab/runs/distill-amx/probes/data_rate.py int4:16 bf16-torch:128
"""

import os
import sys
import time

from specdecode import SpeculativeDecoder
from specdecode.bench.suites import load_suite
from specdecode.distill.data import generate_each, top_distributions
from specdecode.models.loading import load_model
from specdecode.request import GenerationRequest

CATEGORIES = ("chat", "creative_writing", "translation", "question_answering")
TOP_K, NEW = 32, 96
SAMPLES = int(os.environ.get("SAMPLES", "2"))  # answers per prompt at T = 0.7
NAME = "qwen2.5-coder-1.5b-instruct"

configs = [(q, int(r)) for q, r in (a.split(":") for a in sys.argv[1:])]
engines = {}
for q in sorted({q for q, _ in configs}):
    name, kernel = (
        (f"{NAME}:int4", "auto") if q == "int4" else (NAME, "off" if q == "bf16-torch" else "auto")
    )
    target = load_model(name, dtype="bfloat16", kernel=kernel, role="target")
    engines[q] = SpeculativeDecoder(target, None, generation_config="none")
any_engine = next(iter(engines.values()))
vocab = any_engine.target.model.config.vocab_size
prompts = [p.turns[0] for p in load_suite(None) if p.category in CATEGORIES]
jobs = [
    (
        any_engine.encode_prompt(text, chat=True),
        GenerationRequest(
            NEW, any_engine.sampling_params(temperature=t), seed=i * (SAMPLES + 1) + s
        ),
    )
    for i, text in enumerate(prompts)
    for s, t in enumerate((0.0,) + (0.7,) * SAMPLES)
]


def run(engine, chosen, rows) -> tuple[float, int, dict]:
    kept: dict[int, list] = {}

    def keep(index, logits):
        kept.setdefault(index, []).append(top_distributions(logits, vocab, TOP_K))

    start = time.perf_counter()
    out, tokens = {}, 0
    for index, result in generate_each(engine, chosen, rows, on_logits=keep):
        out[index] = list(result.token_ids)
        kept.pop(index)
        tokens += len(out[index])
    return time.perf_counter() - start, tokens, out


if __name__ == "__main__":
    first = None
    for q, rows in configs:
        engine = engines[q]
        run(engine, jobs[:rows], rows)  # warm-up
        seconds, tokens, out = run(engine, jobs, rows)
        greedy = {i: out[i] for i in range(0, len(jobs), SAMPLES + 1)}
        same = (
            ""
            if first is None
            else f", greedy answers as the first: {sum(greedy[i] == first[i] for i in greedy)}/{len(greedy)}"
        )
        first = first or greedy
        print(
            f"{q:>5} rows {rows:3d}: {len(jobs)} answers, {tokens} tokens in {seconds:6.1f} s = {tokens / seconds:6.1f} answer tok/s{same}",
            flush=True,
        )
