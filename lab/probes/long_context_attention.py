"""The target's forward after a long context: specdecode's attention for few query tokens
(kernels/attention.py) against PyTorch's SDPA, side by side in one process.

    python lab/probes/long_context_attention.py --past 1500,3000 --new 5

After a prompt of `past` random tokens, forwards over `new` tokens alternate between the two
attention paths (MAX_KEYS switched per call) and roll back, so the machine's drift touches
both alike. The two paths round differently in bfloat16; the table says whether the argmax of
every row agreed in the last pair of forwards.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdecode.kernels.attention as attention
from specdecode import load_model
from specdecode.core.cache import KVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--past", default="1500,3000", help="cached tokens before the forward")
    parser.add_argument("--new", type=int, default=5, help="new tokens per forward")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    target = load_model(args.target, dtype="bfloat16", device="cpu")
    if target.model.config._attn_implementation != attention.NAME:
        raise SystemExit(f"the target does not run {attention.NAME!r} attention (kernel off?)")
    gen = torch.Generator().manual_seed(0)
    paths = {"specdecode": 10**9, "SDPA": 0}  # MAX_KEYS per path
    print(f"{args.target}, {args.new} new tokens, median of {args.repeats}\n")
    print("| cached tokens | specdecode ms | SDPA ms | SDPA / specdecode | same argmax |")
    print("|---|---|---|---|---|")
    for past in (int(p) for p in args.past.split(",")):
        cache = KVCache(target.model)
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        logits: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            cache.forward(torch.randint(0, 30000, (past,), generator=gen), last_only=True)
            for _ in range(args.repeats):
                ids = torch.randint(0, 30000, (args.new,), generator=gen)
                for name, max_keys in paths.items():
                    attention.MAX_KEYS = max_keys
                    start = time.perf_counter()
                    logits[name] = cache.forward(ids)
                    seconds[name].append(time.perf_counter() - start)
                    cache.rollback(past)
        ours, sdpa = (statistics.median(seconds[name]) for name in paths)
        same = bool((logits["specdecode"].argmax(-1) == logits["SDPA"].argmax(-1)).all())
        print(f"| {past} | {ours * 1e3:.1f} | {sdpa * 1e3:.1f} | {sdpa / ours:.2f} | {same} |")


if __name__ == "__main__":
    main()
