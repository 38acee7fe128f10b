"""The lean forward's layer loop in C++ against the same loop in Python, side by side.

    python lab/probes/layer_loop.py --rounds 16
    python lab/probes/layer_loop.py --rounds 16 --compare groups

`--compare groups`: the C++ loop with a layer's q, k, v (and gate, up) as one `linear_group`
(one parallel region) against one call each.

Loads the target (`--target`, as decoding loads it: float32 residual stream where quantized)
and the draft (`--draft`, loaded as a draft is), prefills `--prompt` random tokens into a
LeanCache of each, checks that both loops give the same logits and keys/values bit for bit, then
alternates the two (`lean.NATIVE_LOOP`) round by round in this one process: each round times
`--repeats` forwards of each size on each side, rolled back after each. Prints the median ms per
forward and the median of the per-round ratios (new / old): the VM's speed drifts between
processes, so only a within-process comparison means anything.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdecode.models.lean as lean
from specdecode import load_model
from specdecode.kernels.build import extension
from specdecode.models.lean import LeanCache, target_residual


def forward_ms(cache: LeanCache, ids: torch.Tensor, past: int, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        cache.forward(ids)
        cache.rollback(past)
    return (time.perf_counter() - start) / repeats * 1e3


def use(side: bool, compare: str) -> None:
    """The new (True) or old (False) side of the comparison, for every forward from now on."""
    if compare == "loop":
        lean.NATIVE_LOOP = side
    else:
        lean.NATIVE_LOOP = True
        extension().set_linear_groups(side)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--target-rows", default="1,3", help="new tokens per target forward")
    parser.add_argument("--draft-rows", default="1,2", help="new tokens per draft forward")
    parser.add_argument("--prompt", type=int, default=150, help="cached tokens before")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--compare", choices=("loop", "groups"), default="loop")
    parser.add_argument("--repeats", type=int, default=6, help="forwards per size, side, round")
    args = parser.parse_args()
    target = load_model(args.target, device="cpu", role="target").model
    draft = load_model(args.draft, device="cpu", role="draft").model
    caches = {
        args.target: (
            LeanCache(target, lean.VERIFY_TOKENS, residual=target_residual(target)),
            [int(n) for n in args.target_rows.split(",")],
        ),
        args.draft: (LeanCache(draft), [int(n) for n in args.draft_rows.split(",")]),
    }
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (args.prompt,), generator=generator)
    times: dict[tuple[str, int, bool], list[float]] = {}
    with torch.inference_mode():
        for name, (cache, sizes) in caches.items():
            if cache._native is None:
                raise SystemExit(f"{name}: the layer loop cannot run in C++ here")
            cache.forward(prompt)
            for n in sizes:
                ids = torch.randint(0, 1000, (n,), generator=generator)
                runs = []
                for side in (True, False):
                    use(side, args.compare)
                    logits = cache.forward(ids)
                    runs.append((logits, cache.kv[:, :, :, args.prompt : args.prompt + n].clone()))
                    cache.rollback(args.prompt)
                same = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
                print(f"{name}, {n} rows: both sides bit for bit the same: {same}")
        for _ in range(args.rounds):
            for side in (True, False):
                use(side, args.compare)
                for name, (cache, sizes) in caches.items():
                    for n in sizes:
                        ids = torch.randint(0, 1000, (n,), generator=generator)
                        ms = forward_ms(cache, ids, args.prompt, args.repeats)
                        times.setdefault((name, n, side), []).append(ms)
    use(True, args.compare)
    old, new = (
        ("Python loop", "C++ loop") if args.compare == "loop" else ("one call each", "groups")
    )
    rounds = f"{new} / {old}, median of {args.rounds} rounds"
    print(f"\n| model | rows | {old} ms | {new} ms | {rounds} |\n|---|---:|---:|---:|---:|")
    for name, (_, sizes) in caches.items():
        for n in sizes:
            after, before = times[(name, n, True)], times[(name, n, False)]
            ratio = statistics.median(a / b for a, b in zip(after, before, strict=True))
            print(
                f"| {name} | {n} | {statistics.median(before):.2f} | "
                f"{statistics.median(after):.2f} | {ratio:.3f} |"
            )


if __name__ == "__main__":
    main()
