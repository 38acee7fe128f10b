"""One sampled token's draw on the CPU: PyTorch's multinomial (what `sample` ran before) against
`draw` (the inverse CDF over blocks), on a vocabulary's probabilities at T = 0.7 (the target's
151,936 ids and the draft vocabulary's 65,558), one draw and eight with replacement (a token
tree's children); best of 200 calls each, interleaved; and whether both sample the same
distribution (total variation of 200k draws each over the most likely tokens).

    PYTHONPATH=src python lab/runs/sampling-cpu/draw_cost.py
"""

import time

import torch

from specdecode.sampling import draw


def best_ms(fn, n: int = 200) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    print(f"threads {torch.get_num_threads()}\n")
    print("| vocabulary | draws | multinomial ms | draw ms | multinomial / draw |")
    print("|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for vocab in (151936, 65558):
        # a language model's shape: a few likely tokens, a long tail (Zipf-like logits)
        logits = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
        probs = (logits[torch.randperm(vocab, generator=g)] / 0.7).softmax(-1)
        for count in (1, 8):
            old = best_ms(
                lambda p=probs, c=count: torch.multinomial(p, c, replacement=c > 1, generator=g)
            )
            new = best_ms(lambda p=probs, c=count: draw(p, c, g))
            print(f"| {vocab} | {count} | {old:.3f} | {new:.3f} | {old / new:.1f}x |", flush=True)
    n = 200_000
    top = probs.topk(50).indices
    a = torch.multinomial(probs, n, replacement=True, generator=g)
    b = draw(probs, n, g)
    freq = [torch.bincount(t, minlength=len(probs))[top].double() / n for t in (a, b)]
    tv = 0.5 * (freq[0] - freq[1]).abs().sum().item()
    print(f"\n200k draws each (vocabulary {len(probs)}), the 50 likeliest tokens' frequencies: "
          f"total variation between the samplers {tv:.4f}; to the probabilities "
          f"{0.5 * (freq[1] - probs[top].double()).abs().sum().item():.4f} (draw), "
          f"{0.5 * (freq[0] - probs[top].double()).abs().sum().item():.4f} (multinomial)")  # fmt: skip


if __name__ == "__main__":
    main()
