"""Our autoregressive loop beside HF `generate` alone: same model, prompt, token count, greedy.

    python lab/probes/ar_vs_hf.py --model qwen2.5-coder-0.5b-instruct --repeats 2

Checks that the baseline every speedup is measured against is not slower than HF's own.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode import SpeculativeDecoder, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    loaded = load_model(args.model, device="cpu")
    prompt = "Write a Python function that checks whether a string is a palindrome."
    ids = SpeculativeDecoder(loaded).encode_prompt(prompt, chat=True)
    loaded.model.generation_config.eos_token_id = None  # both produce exactly max_new_tokens
    inputs = torch.tensor([ids])
    n = args.max_new_tokens
    for timed in (True, False):
        engine = SpeculativeDecoder(loaded, time_forwards=timed)
        engine.generate(ids, 8, temperature=0.0, eos_token_ids=[])  # warm-up
        for _ in range(args.repeats):
            start = time.perf_counter()
            ours = engine.generate(ids, n, temperature=0.0, eos_token_ids=[]).token_ids
            ours_s = time.perf_counter() - start
            start = time.perf_counter()
            out = loaded.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, do_sample=False
            )
            hf_s = time.perf_counter() - start
            same = out[0, len(ids) :].tolist() == ours
            print(
                f"time_forwards={timed}: ours {n / ours_s:.2f} tok/s, HF generate "
                f"{n / hf_s:.2f} tok/s, identical tokens: {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
