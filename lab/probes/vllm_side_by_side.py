"""vLLM's speculative methods and our proposers inside vLLM, one server after another, on the suite.

    python lab/probes/vllm_side_by_side.py --vllm-python /work/vllm-venv/bin/python \
        --target ~/.cache/specdecode/qwen2.5-coder-1.5b-instruct \
        --draft-model ~/.cache/specdecode/qwen2.5-coder-0.5b-instruct --out lab/runs/vllm-side-by-side/run1

The candidates of `tune --engine vllm` (bench/tune_vllm.py's `measure`), chosen by hand at one k:
each setting starts its own vLLM server, runs `bench --server` on it alone (one category at a
time, acceptance from vLLM's counters), and stops it; the records of every setting are then put
together in OUT (identity against the `ar` server's texts) and reported as `specdecode report
OUT` would. Settings whose server fails to start are listed and skipped; settings measured by an
earlier call (their folder's summary written) are kept.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from specdecode.bench.server_bench import merge_runs
from specdecode.bench.tune_vllm import Candidate, VllmTuneConfig, measure, ours_candidate


def candidates(k: int, draft_model: str | None) -> list[Candidate]:
    """vLLM alone, its n-gram method and ours, our suffix drafter, its draft-model method."""
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}  # fmt: skip
    ours_ngram = ours_candidate("NgramProposer", "ngram:1-3", k)
    ours_suffix = ours_candidate("SuffixProposer", "suffix", k)
    out = [
        Candidate("ar", None),
        Candidate(f"vllm-ngram k={k}", ngram),
        replace(ours_ngram, label=f"ours-ngram k={k}"),
        replace(ours_suffix, label=f"ours-suffix k={k}"),
    ]
    if draft_model:
        model = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k}
        out.append(Candidate(f"vllm-draft k={k}", model))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--target", required=True, help="the target's folder")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--limit", type=int, default=1)
    parser.add_argument("--categories", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    config = VllmTuneConfig(
        python=args.vllm_python,
        target=args.target,
        drafts=[],
        out=str(out),
        categories=args.categories.split(",") if args.categories else None,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        vllm_args=["--max-model-len", "4096"],
    )
    folders, failed = measure(config, candidates(args.k, args.draft_model), out)
    merge_runs(folders, out, command=" ".join(sys.argv), failed=failed)
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
