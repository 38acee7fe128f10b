import sys
import time

import torch

from specdecode.distill.train import add_lora, autocast_context
from specdecode.models.loading import load_model

what = sys.argv[1]
if what == "train":
    d = load_model("qwen2.5-coder-0.5b-instruct", dtype="float32", kernel="off", role="draft")
    m = add_lora(d.model, 16, 32.0)
    m.train()
    for L in (170, 680):
        ids = torch.randint(0, 50000, (1, L))
        for name, dt in (("fp32", None), ("bf16", torch.bfloat16)):
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                with autocast_context(torch.device("cpu"), dt):
                    out = m(input_ids=ids, logits_to_keep=L - 40).logits
                out[0, :, :151000].float().logsumexp(-1).sum().backward()
                ts.append(time.perf_counter() - t)
            print(what, L, name, [round(x, 2) for x in ts], "pos/s", round(L / min(ts)), flush=True)
    # batched 4 x 170
    ids = torch.randint(0, 50000, (4, 170))
    for name, dt in (("fp32", None), ("bf16", torch.bfloat16)):
        ts = []
        for _ in range(2):
            t = time.perf_counter()
            with autocast_context(torch.device("cpu"), dt):
                out = m(input_ids=ids, logits_to_keep=130).logits
            out[:, :, :151000].float().logsumexp(-1).sum().backward()
            ts.append(time.perf_counter() - t)
        print(
            "batch4x170", name, [round(x, 2) for x in ts], "pos/s", round(680 / min(ts)), flush=True
        )
else:
    from specdecode import SpeculativeDecoder
    from specdecode.batch_session import BatchSession
    from specdecode.request import GenerationRequest

    spec = sys.argv[2]
    t = load_model(spec, dtype="bfloat16", role="target")
    dec = SpeculativeDecoder(t, None)
    prompts = [
        f"Write a short story about a {w} who learns to {v}."
        for w in ("cat", "robot", "sailor", "baker", "pilot", "child", "wizard", "farmer")
        for v in ("sing", "fly", "cook", "paint")
    ]
    for rows in [int(x) for x in sys.argv[3].split(",")]:
        s = BatchSession(dec, max_rows=rows, max_len=512)
        req = GenerationRequest(max_new_tokens=128, chat=True)
        st = time.perf_counter()
        gens = s.generate_all(prompts[: rows * 2], req)
        sec = time.perf_counter() - st
        toks = sum(len(g.token_ids) for g in gens)
        print(
            spec,
            "rows",
            rows,
            "answers",
            len(gens),
            "tokens",
            toks,
            "s",
            round(sec, 1),
            "tok/s",
            round(toks / sec, 1),
            flush=True,
        )
        del s
    from specdecode.bench.quality import answer_log_probs
    from specdecode.distill.data import top_distributions

    pid = dec.encode_prompt(prompts[0], chat=True)
    ans = gens[0].token_ids
    for _ in range(3):
        st = time.perf_counter()
        top_distributions(answer_log_probs(t.model, pid, ans), 151000, 32)  # the scoring forward
        sec = time.perf_counter() - st
        print(
            "score positions",
            len(pid) + len(ans),
            "s",
            round(sec, 2),
            "pos/s",
            round((len(pid) + len(ans)) / sec),
        )
