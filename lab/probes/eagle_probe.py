"""History: this probe measured the EAGLE-1-style head that `distill --kind eagle` trained until
the EAGLE-3 head replaced it (lab/notes/2026-12-06-eagle3-heads.md); it runs at commit c1c08e7
and earlier, not against today's models/eagle_head.py.

Offline probe of an EAGLE-style head against the model draft, on a distillation's cached
answers (`specdecode distill ... --out DIR`): trains a head for `--seconds` on the answers of
most prompts and measures, on the answers of the others (held out by prompt), how many tokens
each drafter's greedy chain of `--k` would have had accepted at every answer position (the
target's own greedy token as the reference: teacher forcing up to the position, then the
drafter's own chain). The head's chain feeds its own predicted features, as decoding does.

    python lab/probes/eagle_probe.py runs/eagle-data --seconds 1200 --out runs/eagle-probe

`--extra DIR` adds another distillation's answers to the training (never the held-out prompts'):
text the draft model wrote, say, labelled by the target's own features and distributions.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from specdecode.core.cache import keep_features
from specdecode.distill.data import AnswerStore
from specdecode.distill.eagle import FeatureAnswer, evaluate, head_step, target_features
from specdecode.distill.settings import Budget, DistillSettings
from specdecode.distill.train import Checkpoints, train
from specdecode.models.eagle_head import EagleHead
from specdecode.models.files import load_json
from specdecode.models.lean import target_cache
from specdecode.models.loading import load_model


def chain_lengths(matches: list[bool], k: int) -> list[int]:
    """At each position, the run of consecutive matches starting there, capped at k."""
    out, run = [0] * len(matches), 0
    for i in range(len(matches) - 1, -1, -1):
        run = run + 1 if matches[i] else 0
        out[i] = min(run, k)
    return out


@torch.inference_mode()
def head_chains(head, embed, seq, greedy_next, k) -> list[int]:
    """Accepted tokens of the head's chain of k at every answer position (simulated decoding)."""
    from transformers import DynamicCache

    tokens, feats = seq.ids, seq.features
    cache = DynamicCache()
    accepted = []
    # head position j reads f_j and t_{j+1}, predicting t_{j+2}
    p0 = seq.start - 1  # the first position whose prediction is an answer token
    head(embed[tokens[1:p0]], feats[: p0 - 1], torch.arange(p0 - 1), cache)
    for j in range(p0 - 1, tokens.shape[0] - 2):
        g = head(embed[tokens[j + 1 : j + 2]], feats[j : j + 1], torch.tensor([j]), cache)
        kept = cache.get_seq_length()
        n, pos, ok = 0, j + 2, True
        while ok and n < k and pos < tokens.shape[0]:
            token = int(head.logits(g[-1:]).argmax(-1))
            ok = token == greedy_next[pos - 1]
            if ok:
                n += 1
                if n < k:
                    g = head(embed[torch.tensor([token])], g[-1:], torch.tensor([pos - 1]), cache)
            pos += 1
        if cache.get_seq_length() > kept:
            cache.crop(kept - cache.get_seq_length())
        accepted.append(n)
    return accepted


def cached_answers(folder: Path, tag: str = "") -> tuple[list, dict]:
    """Every answer cached in a distillation's folder (keys prefixed by `tag`: answers of
    another folder keep their own features), and the settings they were made with."""
    data_dir = folder / "data"
    settings = load_json(data_dir / "config.json")["settings"]
    store = AnswerStore(data_dir, settings)
    answers = store.load([key for held in store.shards.values() for key in held])
    for a in answers:
        a.key = f"{tag}:{a.key}" if tag else a.key
    return answers, settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("distill_dir")
    parser.add_argument("--target", default=None, help="default: the one the data was made with")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--held-out", type=float, default=0.15)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=65536)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--autocast", choices=("off", "bf16"), default="off")
    parser.add_argument(
        "--init", default=None, help="start from this head folder's weights (trained further)"
    )
    parser.add_argument(
        "--prompt-positions",
        action="store_true",
        help="train on the prompts' positions too (held-out scoring stays on answers)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="DIR",
        help="another distillation's cached answers (e.g. written by the draft model), trained "
        "on too, but for the held-out prompts'; the target's features are computed for them",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    answers, settings = cached_answers(Path(args.distill_dir))
    target_name = args.target or settings["target"]
    extra = [a for folder in args.extra for a in cached_answers(Path(folder), folder)[0]]
    print(f"{len(answers)} answers (+ {len(extra)} extra), target {target_name}", flush=True)

    loaded = load_model(target_name, role="target")
    target = loaded.model
    keep_features(target)
    started = time.perf_counter()
    seqs, by_prompt = [], {}
    cached_path = out / "features.pt"
    cached = torch.load(cached_path) if cached_path.exists() else {}
    extra_seqs = []
    for i, a in enumerate([*answers, *extra]):
        tokens = torch.cat([a.prompt_ids, a.answer_ids]).long()
        if a.key not in cached:
            cached[a.key] = target_features(target, target_cache, tokens)
        seq = FeatureAnswer(tokens, cached[a.key], int(a.prompt_ids.numel()), a.key)
        seqs.append(seq)
        if i >= len(answers):
            extra_seqs.append((a, seq))
        else:
            by_prompt.setdefault(a.prompt_id, []).append((a, seq))
    torch.save(cached, cached_path)
    feature_s = time.perf_counter() - started
    n_tok = sum(int(s.ids.shape[0]) for s in seqs)
    print(f"features: {n_tok} positions in {feature_s:.0f} s", flush=True)

    prompts = sorted(by_prompt)
    random.Random(0).shuffle(prompts)
    n_held = max(1, int(len(prompts) * args.held_out))
    held = set(prompts[:n_held])
    train_items = [s for p in prompts[n_held:] for _, s in by_prompt[p]]
    train_items += [s for a, s in extra_seqs if a.prompt_id not in held]
    if args.prompt_positions:  # every position scored: start 1 makes `first` 0
        train_items = [FeatureAnswer(s.ids, s.features, 1, s.key) for s in train_items]
    # greedy answers only: their tokens are the target's own greedy chain
    test = [(a, s) for p in prompts[:n_held] for a, s in by_prompt[p] if a.temperature == 0]

    head = EagleHead.from_target(target)
    if args.init:
        from safetensors.torch import load_file

        head.load_state_dict(load_file(str(Path(args.init) / "head.safetensors")), strict=False)
    head.attach_output(target, args.draft_vocab, loaded.tokenizer)
    head.output.float()
    embed = target.get_input_embeddings().weight.detach()
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    settings = DistillSettings(
        target=target_name,
        draft=args.draft,
        out=str(out),
        lr=args.lr,
        budget=Budget.parse(f"{int(args.seconds)}s"),
        checkpoint_every=10**9,
    )
    before = evaluate(head, embed, [s for _, s in test])
    state = train(
        head,
        train_items,
        settings,
        0,
        torch.device("cpu"),
        Checkpoints(
            out / "checkpoints",
            {"probe": time.time()},
            weights=lambda m: {},
            load_weights=lambda m, w: None,
        ),
        one_step=lambda opt, batch: head_step(head, embed, autocast, opt, batch),
    )
    after = evaluate(head, embed, [s for _, s in test])
    print(
        f"trained: {state.step} steps, {state.tokens} tokens; held out {before} -> {after}",
        flush=True,
    )

    # the target's greedy next token at every position, from its features (full vocabulary)
    from specdecode.models.eagle_head import output_weight

    full = output_weight(target).float()
    draft = load_model(args.draft, role="draft", draft_vocab=args.draft_vocab).model
    head.eval()
    totals = {"head": [], "draft": []}
    per_cat: dict[str, dict[str, list[int]]] = {}
    for a, seq in test:
        with torch.inference_mode():
            greedy_next = (seq.features.float() @ full.T).argmax(-1).tolist()  # next after pos
            d_logits = draft(seq.ids[None]).logits[0].float()
        d_match = [int(d_logits[p].argmax()) == greedy_next[p] for p in range(len(seq.ids) - 1)]
        p0 = seq.start - 1
        # the head's chain at j (committed up to t_{j+1}) against the draft's at p = j + 1
        h_chain = head_chains(head, embed, seq, greedy_next, args.k)
        d_chain = chain_lengths(d_match, args.k)[p0 : len(seq.ids) - 1]
        assert len(h_chain) == len(d_chain), (len(h_chain), len(d_chain))
        totals["head"] += h_chain
        totals["draft"] += d_chain
        cat = per_cat.setdefault(a.category, {"head": [], "draft": []})
        cat["head"] += h_chain
        cat["draft"] += d_chain

    def summary(chains):
        n = len(chains)
        return {
            "positions": n,
            "mean_accepted": round(sum(chains) / n, 3),
            "first_token_rate": round(sum(c >= 1 for c in chains) / n, 3),
        }

    result = {
        "target": target_name,
        "k": args.k,
        "train_answers": len(train_items),
        "test_answers": len(test),
        "held_out_prompts": sorted(held),
        "feature_seconds": round(feature_s, 1),
        "training": {"steps": state.step, "tokens": state.tokens, "seconds": state.seconds},
        "held_out_loss": {"before": before, "after": after},
        "curve_tail": state.curve[-5:],
        "all": {name: summary(c) for name, c in totals.items()},
        "per_category": {
            cat: {name: summary(c) for name, c in d.items()} for cat, d in sorted(per_cat.items())
        },
    }
    (out / "probe.json").write_text(json.dumps(result, indent=2))
    # a head folder as `specdecode distill --kind eagle` writes it: --draft eagle:OUT/head
    from specdecode.distill.result import vocab_digest
    from specdecode.models.eagle_head import target_fingerprint, write_head

    record = {
        "kind": "eagle",
        "target": target_name,
        "target_config": target_fingerprint(target),
        "tokenizer": vocab_digest(loaded.tokenizer),
        "command": " ".join(sys.argv),
        "head": {"layers": 1, "train_vocab": int(head.output.keep.numel())},
        "training": result["training"],
        "probe": result["all"],
    }
    write_head(out / "head", head, record)
    print(json.dumps(result["all"], indent=2))
    for cat, d in result["per_category"].items():
        print(cat, d["head"]["mean_accepted"], d["draft"]["mean_accepted"])


if __name__ == "__main__":
    main()
