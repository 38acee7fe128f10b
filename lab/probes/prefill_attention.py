"""A long prefill's attention on the lean forward: PyTorch's fused attention (what
`LeanCache._attend_prefill` runs past VERIFY_TOKENS rows) against the explicit matmuls over the
whole [H, n, L] scores that ran before, alternating in one process.

    python lab/probes/prefill_attention.py --model qwen2.5-coder-1.5b-instruct:int4 --tokens 512,200

The same model and prompt both ways, rounds alternating (A B B A ...); prints, for each, the
median ms of the attention calls summed over a forward's layers (timed call by call) and of the
whole forward, their ratios, and whether the last position's argmax agrees. The projections
are whatever a prefill takes here (`SPECDECODE_PREFILL_LINEARS`); only the attention changes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import load_model
from specdecode.models.lean import LeanCache, target_cache


def matmul_attention(self: LeanCache, q: torch.Tensor, kv: torch.Tensor, past: int) -> torch.Tensor:
    """The attention before `_attend_prefill`: scaled queries of one key/value head side by side,
    an additive causal mask over [n, L], bmm, softmax, bmm."""
    n, d, kv_heads = q.shape[0], self.head_dim, self.kv_heads
    group, kv_len = self.heads // kv_heads, past + n
    q = (q * self.scale).view(n, kv_heads, group, d).permute(1, 2, 0, 3)
    q = q.reshape(kv_heads, group * n, d)
    rows = torch.arange(past, kv_len)[:, None]
    future = torch.arange(kv_len)[None, :] > rows
    mask = torch.zeros(n, kv_len).masked_fill(future, -torch.inf)
    k_t = kv[0, :, :kv_len].transpose(1, 2)  # [Hkv, d, L]
    scores = torch.baddbmm(mask.repeat(group, 1), q, k_t)
    out = torch.bmm(scores.softmax(-1), kv[1, :, :kv_len])  # [Hkv, group * n, d]
    return out.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, -1).to(self.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--tokens", default="512,200", help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    model = load_model(args.model, device="cpu").model
    fused = LeanCache._attend_prefill
    spent = [0.0]

    def timed(way):
        def call(self: LeanCache, q: torch.Tensor, kv: torch.Tensor, past: int) -> torch.Tensor:
            start = time.perf_counter()
            out = way(self, q, kv, past)
            spent[0] += time.perf_counter() - start
            return out

        return call

    ways = {"fused attention": timed(fused), "matmuls": timed(matmul_attention)}
    for n in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {name: [] for name in ways}
        attention: dict[str, list[float]] = {name: [] for name in ways}
        last: dict[str, int] = {}
        order = list(ways)
        for r in range(args.rounds + 1):  # the first round warms up, uncounted
            for name in order if r % 2 else order[::-1]:
                LeanCache._attend_prefill = ways[name]  # type: ignore[method-assign]
                cache = target_cache(model)
                spent[0] = 0.0
                with torch.inference_mode():
                    start = time.perf_counter()
                    logits = cache.forward(ids, last_only=True)
                    seconds = time.perf_counter() - start
                if r:
                    times[name].append(seconds * 1e3)
                    attention[name].append(spent[0] * 1e3)
                last[name] = int(logits.argmax())
        LeanCache._attend_prefill = fused  # type: ignore[method-assign]
        med = {name: statistics.median(t) for name, t in times.items()}
        att = {name: statistics.median(t) for name, t in attention.items()}
        cells = ", ".join(
            f"{name}: attention {att[name]:.0f} ms of {med[name]:.0f} ms "
            f"({n / med[name] * 1e3:.0f} tok/s)"
            for name in ways
        )
        print(
            f"prefill of {n} tokens, medians of {args.rounds}: {cells}; attention "
            f"{att['matmuls'] / att['fused attention']:.2f}x, forward "
            f"{med['matmuls'] / med['fused attention']:.2f}x; next token the same: "
            f"{len(set(last.values())) == 1}"
        )


if __name__ == "__main__":
    main()
