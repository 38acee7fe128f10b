"""Training's answer tokens/s on this CPU: the 0.5B draft in float32 + LoRA 16 (every linear
layer but the output layer), one right-padded forward + backward of `batch` answers per step
(`batch_loss`, as `specdecode distill` trains), with bfloat16 autocast or without; AdamW.
The answers are synthetic (random ids and distributions of the data phase's shapes: prompts of
40 tokens, answers of 90, top-32); the speed does not depend on their values. 12 steps, the
first 2 not timed; prints answer tokens/s and the peak RSS. Modes: `off` (float32), `bf16`
(float32 weights under bfloat16 autocast, as train.py does), `bf16w` (the frozen weights held in
bfloat16, the adapters in float32, under autocast).

    PYTHONPATH=src python lab/runs/distill-amx/probes/train_rate.py bf16 4 [keep]

`keep`: glibc's malloc keeps freed memory (`keep_freed_memory`, as `specdecode distill` trains).
Run against an earlier checkout's src/ to compare the code before and after.
"""

import resource
import sys
import time

import torch

from specdecode.distill.data import Answer
from specdecode.distill.train import add_lora, batch_loss
from specdecode.models.loading import load_model

mode, batch = sys.argv[1], int(sys.argv[2])
if "keep" in sys.argv[3:]:  # glibc keeps freed memory, as `specdecode distill` now trains
    from specdecode.distill.train import keep_freed_memory

    assert keep_freed_memory(torch.device("cpu"))
PROMPT, ANSWER, K, STEPS = 40, 90, 32, 12
gen = torch.Generator().manual_seed(0)
base_dtype = "bfloat16" if mode == "bf16w" else "float32"  # bf16w: the frozen weights in bfloat16
model = load_model("qwen2.5-coder-0.5b-instruct", dtype=base_dtype, kernel="off", role="draft")
vocab = model.model.config.vocab_size
m = add_lora(model.model, 16, 32.0)
m.train()
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=2e-4)


def answer(i: int) -> Answer:
    logits = torch.randn(ANSWER, K, generator=gen)
    return Answer(
        key=str(i),
        prompt_id=str(i),
        category="chat",
        temperature=0.0,
        prompt_ids=torch.randint(0, vocab, (PROMPT,), generator=gen, dtype=torch.int32),
        answer_ids=torch.randint(0, vocab, (ANSWER,), generator=gen, dtype=torch.int32),
        top_logprobs=(logits.log_softmax(-1) - 0.1).half(),
        top_ids=torch.randint(0, vocab, (ANSWER, K), generator=gen, dtype=torch.int32),
        tail=torch.full((ANSWER,), 0.1),
    )


cpu, dt = torch.device("cpu"), (None if mode == "off" else torch.bfloat16)
times = []
for s in range(STEPS):
    answers = [answer(s * batch + j) for j in range(batch)]
    start = time.perf_counter()
    (batch_loss(m, answers, vocab, "kl", cpu, dt) / (batch * ANSWER)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - start)
timed = times[2:]
print(
    f"{mode:>4} batch {batch:2d}: {batch * ANSWER * len(timed) / sum(timed):7.1f} answer tok/s "
    f"(steps {[round(t, 2) for t in timed]}), peak RSS "
    f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB",
    flush=True,
)
