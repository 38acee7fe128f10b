"""The engine on a CUDA device: exactness with every kind of drafter, the static store's batches,
and autoregressive against speculative decoding on real-shaped random models.

    python lab/probes/gpu_check.py --out DIR            # on a machine with a GPU
    python lab/probes/gpu_check.py --out DIR --small    # a dry run of the same steps (any device)

Part 1 (tiny float32 Llama, its noisy copy as draft): greedy output of each drafter equal to the
target's own, and `generate_batch` (the static store) equal to each prompt alone, greedy and
seeded sampling. Part 2 (bfloat16, random weights shaped like Llama-3-8B and Llama-3.2-1B): the
verify cost v(n) in one-token forwards, the draft's cost c, and decode tokens/s of the target
alone, with the 1B draft (measured policy and fixed k=4), with suffix drafting, and 8 prompts
batched. Random weights mean the 1B draft agrees with the target by chance only: that row shows
whether the measured policy steps aside. Writes DIR/gpu_check.json; prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
import traceback
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdecode import SpeculativeDecoder
from specdecode.drafters.factory import hybrid_drafter, resolve_draft
from specdecode.models.loading import wrap_model

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=None,
)
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    eos_token_id=None,
)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    eos_token_id=None,
)
SMALL_8B = {
    **LLAMA_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "vocab_size": 4096,
}
SMALL_1B = {
    **LLAMA_1B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "vocab_size": 4096,
}


def build(fields: dict, seed: int, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**fields, dtype=dtype)).to(dtype)
    return model.eval()


def noisy(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    draft = copy.deepcopy(model)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(
                torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
                * noise
                * p.std()
            )
    return draft


def decode_rate(result) -> float:
    s = result.stats
    return (s.new_tokens - 1) / max(s.wall_time_s - s.ttft_s, 1e-9)


def first_difference(model, prompt: list[int], want: list[int], got: list[int]) -> str:
    """Where `got` leaves `want` first, and the target's logit gap there between the two tokens
    over a fresh forward (bfloat16: invariant 1 allows a first difference at a near-tie only)."""
    i = next(i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([prompt + want[:i]], device=device)
        logits = model(ids).logits[0, -1].float()
    gap = (logits[want[i]] - logits[got[i]]).item()
    return f"first difference at token {i}: logit gap {gap:.4f} (logits' std {logits.std():.3f})"


def exactness(device: torch.device, rows: list, record: dict) -> None:
    target = wrap_model(build(TINY, 0, device, torch.float32), name="tiny")
    draft = noisy(target.model, 0.05, seed=1)
    prompts = [[1, 2, 3], [7] * 12, [5, 9, 5, 9, 5], [100, 101]]
    ar = SpeculativeDecoder(target)
    expected = [ar.generate(p, max_new_tokens=48).token_ids for p in prompts]
    settings = {
        "chain k=4 fixed": dict(draft=draft, k=4, k_policy="fixed"),
        "chain k=4 cost": dict(draft=draft, k=4),
        "tree static:3,2,1": dict(draft=draft, tree="static:3,2,1"),
        "tree dynamic:6": dict(draft=draft, tree="dynamic:6"),
        "early-exit:1": dict(draft=resolve_draft("early-exit:1", target)),
        "ngram": dict(draft=resolve_draft("ngram", target)),
        "suffix": dict(draft=resolve_draft("suffix", target)),
        "draft+suffix": dict(draft=hybrid_drafter(draft, target)),
    }
    for name, options in settings.items():
        engine = SpeculativeDecoder(target, **options)
        got = [engine.generate(p, max_new_tokens=48) for p in prompts]
        same = all(g.token_ids == e for g, e in zip(got, expected, strict=True))
        accepted = sum(g.stats.accepted for g in got)
        drafted = sum(g.stats.drafted for g in got)
        rows.append(
            ("exact", name, "identical" if same else "DIFFERENT", f"{accepted}/{drafted} accepted")
        )
        record.setdefault("exact", {})[name] = {
            "identical": same,
            "accepted": accepted,
            "drafted": drafted,
        }
    for temperature in (0.0, 0.8):
        engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
        batch = engine.generate_batch(prompts, 32, temperature=temperature, seed=3, max_batch=3)
        alone = [engine.generate(p, 32, temperature=temperature, seed=3) for p in prompts]
        same = all(b.token_ids == a.token_ids for b, a in zip(batch, alone, strict=True))
        name = f"static store batch, T={temperature}"
        rows.append(("exact", name, "as alone" if same else "DIFFERENT", ""))
        record.setdefault("exact", {})[name] = {"identical": same}


def verify_costs(model: torch.nn.Module, device: torch.device, ns: list[int]) -> dict[int, float]:
    """Seconds of one forward of n new tokens after a 256-token prefix (median of 5)."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 256), device=device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        out = {}
        for n in ns:
            new = torch.randint(0, vocab, (1, n), device=device)
            times = []
            for _ in range(7):
                torch.cuda.synchronize() if device.type == "cuda" else None
                t0 = time.perf_counter()
                model(new, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize() if device.type == "cuda" else None
                times.append(time.perf_counter() - t0)
                cache.crop(-n)  # back to the 256-token prefix
            out[n] = sorted(times[2:])[2]
    return out


def real_shaped(
    device: torch.device, small: bool, dtype: torch.dtype, rows: list, record: dict
) -> None:
    target_model = build(SMALL_8B if small else LLAMA_8B, 0, device, dtype)
    draft_model = build(SMALL_1B if small else LLAMA_1B, 1, device, dtype)
    ns = [1, 2, 4, 8, 16, 32, 64]
    v = verify_costs(target_model, device, ns)
    c = verify_costs(draft_model, device, [1])[1] / v[1]
    record["v_seconds"] = v
    record["c"] = c
    rows.append(("cost", "target T(1)", f"{v[1] * 1e3:.2f} ms", ""))
    rows.append(("cost", "v(n)/T(1)", " ".join(f"{n}:{v[n] / v[1]:.2f}" for n in ns), ""))
    rows.append(("cost", "draft c", f"{c:.3f}", ""))
    target = wrap_model(target_model, name="llama-3-8b-shape")
    draft = wrap_model(draft_model, name="llama-3.2-1b-shape")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target_model.config.vocab_size, (128,), generator=gen).tolist()
    loop = (prompt[:16] * 8)[:128]  # repeats: something for a suffix drafter to find
    n_new = 32 if small else 128
    ar = SpeculativeDecoder(target)
    settings = {
        "target alone": (ar, prompt),
        "+1B draft, measured policy": (SpeculativeDecoder(target, draft), prompt),
        "+1B draft, fixed k=4": (SpeculativeDecoder(target, draft, k_policy="fixed"), prompt),
        "target alone, repeating prompt": (ar, loop),
        "suffix, repeating prompt": (
            SpeculativeDecoder(target, resolve_draft("suffix", target)),
            loop,
        ),
    }
    reference: dict[int, list[int]] = {}
    base = None
    for name, (engine, p) in settings.items():
        engine.generate(p, n_new)  # warm-up at full length (first CUDA calls, the policy's costs)
        result = engine.generate(p, n_new)
        key = id(p)
        reference.setdefault(key, result.token_ids)
        same = result.token_ids == reference[key]
        where = "" if same else first_difference(target_model, p, reference[key], result.token_ids)
        rate = decode_rate(result)
        base = rate if name == "target alone" else base
        s = result.stats
        detail = f"acc {s.accepted}/{s.drafted}, k_hist {dict(sorted(s.k_hist.items()))}"
        rows.append(
            (
                "decode",
                name,
                f"{rate:.1f} tok/s ({rate / base:.2f}x)",
                detail + ("" if same else f"; {where}"),
            )
        )
        record.setdefault("decode", {})[name] = {
            "tok_s": rate,
            "identical": same,
            "where": where,
            "stats": s.to_dict(),
        }
    prompts = [torch.randint(0, 1000, (64,), generator=gen).tolist() for _ in range(8)]
    for name, engine in (("batch of 8, alone", ar), ("batch of 8, +1B draft", None)):
        engine = engine or SpeculativeDecoder(target, draft)
        engine.generate_batch(prompts, n_new, max_batch=8)  # warm-up: the store, the policy
        t0 = time.perf_counter()
        batch = engine.generate_batch(prompts, n_new, max_batch=8)
        seconds = time.perf_counter() - t0
        total = sum(len(b.token_ids) for b in batch)
        reference.setdefault(-1, [b.token_ids for b in batch])
        same = sum(b.token_ids == r for b, r in zip(batch, reference[-1], strict=True))
        rows.append(
            (
                "batch",
                name,
                f"{total / seconds:.1f} tok/s total",
                f"{same}/8 rows as the target's batch",
            )
        )
        record.setdefault("batch", {})[name] = {"tok_s": total / seconds, "identical_rows": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="small shapes: a dry run")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the real-shaped models' dtype (float32: greedy exact, no near-ties)",
    )
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "errors": [],
    }
    rows: list = []
    args.out.mkdir(parents=True, exist_ok=True)
    for part in (
        lambda: exactness(device, rows, record),
        lambda: real_shaped(device, args.small, args.dtype, rows, record),
    ):
        try:
            part()
        except Exception:  # a probe: report, go on with the next part
            record["errors"].append(traceback.format_exc())
            print(traceback.format_exc())
        (args.out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"\n{record['device']}, torch {record['torch']}")
    for row in rows:
        print(" | ".join(str(x) for x in row))


if __name__ == "__main__":
    main()
