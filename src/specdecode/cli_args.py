"""Arguments every subcommand that runs models shares, and the engine they describe.

`cli.py` (generate, demo), `server/cli_serve.py`, `bench/cli_*.py` and
`models/cli_models.py` import from here; nothing here imports them, so the root command imports
its subcommands one way. Heavy modules are imported inside the functions: building the parser
loads no model code.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdecode.config import RunConfig
    from specdecode.models.loading import LoadedModel
    from specdecode.runtime.engine import SpeculativeDecoder

TREE_HELP = "static:3,2,2,1,1 or dynamic:NODES[,DEPTH,WIDTH[,FLOOR[,LEAF]]]"


def csv_list(text: str) -> list[str]:
    """ "a, b,,c" -> ["a", "b", "c"] (an argparse type)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def int_csv(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4] (an argparse type: a clear error for anything else)."""
    try:
        return [int(part) for part in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--target, --draft, --dtype, --device and --kernel."""
    # --target, --draft, --dtype, --device and --k default to None: unset, they come from
    # --config, then from RunConfig's defaults (config.py)
    parser.add_argument(
        "--target",
        default=None,
        help="preset name, local folder, .gguf or hub id (required); MODEL:int8 / MODEL:int4 runs "
        "it on int8 / 4-bit weights, the model whose output is then reproduced",
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="draft: a model (same forms as --target, of its tokenizer or another; MODEL:int8 / "
        "MODEL:int4 runs it on int8 / 4-bit weights), early-exit:N, ngram[:MIN-MAX], "
        "suffix[:OPTIONS] or MODEL+suffix",
    )
    parser.add_argument("--dtype", default=None, help="bfloat16 (default), float32, float16")
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N (default: cuda if present)"
    )
    add_kernel_arg(parser)


def draft_vocab_value(text: str) -> str:
    """--draft-vocab: a number of token ids or "all", checked here (models/draft_vocab.py)."""
    from specdecode.core.draft_spec import resolve_draft_vocab

    try:
        resolve_draft_vocab(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def add_kernel_arg(parser: argparse.ArgumentParser, draft_vocab: bool = True) -> None:
    """--kernel, and (`draft_vocab`) --draft-vocab beside it: how a loaded model's layers run."""
    if draft_vocab:
        add_draft_vocab_arg(parser)
    parser.add_argument(
        "--kernel",
        choices=("auto", "on", "off"),
        default=None,
        help="bfloat16 linear layers on specdecode's CPU kernel (AVX2, or AVX-512 where the CPU "
        "has it): auto (default: when it builds), on (fail if it cannot), off (plain PyTorch); "
        "also $SPECDECODE_KERNEL",
    )


def add_draft_vocab_arg(parser: argparse.ArgumentParser) -> None:
    from specdecode.core.draft_spec import DEFAULT_DRAFT_VOCAB, DRAFT_VOCAB_ENV

    parser.add_argument(
        "--draft-vocab",
        type=draft_vocab_value,
        default=None,
        metavar="N|all",
        help="a draft model's output layer computes only the first N token ids and the special "
        f"ones (the others are never drafted; output unchanged): default {DEFAULT_DRAFT_VOCAB}, "
        f"all: every id; also ${DRAFT_VOCAB_ENV}",
    )


def k_value(text: str) -> int | str:
    """--k: an integer, or "auto" (this machine's calibration picks it)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def add_drafting_args(parser: argparse.ArgumentParser) -> None:
    """--k and --tree: how much one step drafts."""
    parser.add_argument(
        "--k",
        type=k_value,
        default=None,
        help="tokens drafted per step (default 4); the heuristic's start, the cost policy's max; "
        "auto: the fastest k of this machine's calibration (`specdecode calibrate`)",
    )
    parser.add_argument(
        "--tree",
        default=None,
        metavar="SHAPE",
        help=f"draft a token tree with the draft model: {TREE_HELP} (none: a chain, whatever "
        "--config says; auto: the fastest tree of this machine's calibration, with --k auto "
        "too the fastest tree or chain)",
    )


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """--k-policy, --confidence and --config."""
    from specdecode.core.policies import K_POLICIES

    parser.add_argument(
        "--k-policy",
        choices=K_POLICIES,
        default=None,
        help="how k is chosen each step: cost (default: measured costs, k = 0 where drafting "
        "does not pay), fixed (k every step), heuristic (HF's +2/-1)",
    )
    parser.add_argument(
        "--confidence",
        type=float,
        default=None,
        metavar="P",
        help="stop a model draft before a token whose draft top probability is below P",
    )
    parser.add_argument(
        "--config", default=None, metavar="FILE", help="JSON run config; explicit flags win"
    )


def add_generation_config_arg(parser: argparse.ArgumentParser, unset: str) -> None:
    """--generation-config auto|none: whether unset sampling options take the model's values;
    `unset` says what they are otherwise."""
    parser.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto (default): temperature, top-p and top-k left unset come from the target's "
        f"generation_config.json, where its authors set them; none: {unset}",
    )


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """--config's values (or RunConfig's defaults) under the flags given explicitly."""
    import dataclasses

    from specdecode.config import RunConfig, load_config

    base = load_config(args.config) if args.config else RunConfig()
    category = getattr(args, "category", None)  # generate only: a tuner's per-category choice
    if category is not None:
        if not args.config:
            raise ValueError("--category picks a --config file's per_category entry: no --config")
        if category not in base.per_category:
            known = ", ".join(base.per_category) or "none: the config has no per_category"
            raise ValueError(f"--category {category!r} is not in the config (known: {known})")
        base = base.for_category(category)
    keys = ("target", "draft", "k", "k_policy", "confidence", "tree", "dtype", "device")
    # "auto" (--k, --tree) is resolved once the models are loaded (engine_from_args)
    given = {key: getattr(args, key) for key in keys if getattr(args, key) not in (None, "auto")}
    if given.get("tree") == "none":  # drops a config file's tree: draft a chain
        given["tree"] = None
    run = dataclasses.replace(base, **given)  # validates, the draft spec included
    if run.target is None:
        raise ValueError('a target is needed: --target, or "target" in the --config file')
    return run


def engine_from_args(args: argparse.Namespace) -> SpeculativeDecoder:
    """The engine `generate` and `serve` run: --config under explicit flags, checked before any
    model is loaded (needs the arguments of add_model_args, add_drafting_args and
    add_policy_args; add_generation_config_arg's, where given)."""
    from specdecode import SpeculativeDecoder, load_model
    from specdecode.drafters import resolve_draft
    from specdecode.drafters.cross_tokenizer import CrossTokenizerDrafter
    from specdecode.drafters.eagle import EagleDrafter

    run = run_config_from_args(args)
    draft = run.draft_spec
    if run.confidence is not None and not (draft and draft.is_model_draft):
        raise ValueError("--confidence needs a model draft (a model or early-exit:N)")
    auto = {key for key in ("k", "tree") if getattr(args, key, None) == "auto"}
    if auto:
        check_auto(auto, run)

    target = load_model(run.target, dtype=run.dtype, device=run.device, role="target")
    drafter = resolve_draft(draft, target, dtype=run.dtype, device=run.device)
    k, tree = run.k, run.tree
    if auto:  # this machine's calibration picks them (measured first where not cached)
        k, tree = resolve_auto(auto, run, target, drafter)
    engine = SpeculativeDecoder(
        target,
        drafter,
        k=k,
        k_policy=run.k_policy,
        confidence=run.confidence,
        tree=tree,
        generation_config=getattr(args, "generation_config", "auto"),
    )
    if isinstance(engine.drafter, (CrossTokenizerDrafter, EagleDrafter)):  # say how it drafts
        print(
            f"specdecode: draft {engine.drafter.name}: {engine.drafter.describe()}", file=sys.stderr
        )
    return engine


# -- `auto` on the command line: this machine's calibration picks k or the tree ----------------


def check_auto(auto: set[str], run: RunConfig) -> None:
    """Refuse `--k auto` / `--tree auto` where no calibration can answer, before any loading."""
    flags = " and ".join(f"--{name} auto" for name in sorted(auto))
    draft = run.draft_spec
    if draft is None:
        raise ValueError(f"{flags} needs a --draft: the calibration measures a target/draft pair")
    if "tree" in auto and not draft.is_model_draft:
        raise ValueError(f"--tree auto needs a model draft (a model or early-exit:N), not {draft}")
    if "tree" in auto and run.confidence is not None:
        raise ValueError("--tree auto may pick a tree, and --confidence applies to chains only")


def resolve_auto(
    auto: set[str], run: RunConfig, target: LoadedModel, draft: Any
) -> tuple[int, str | None]:
    """`run`'s (k, tree) with `auto` ("k", "tree" or both) resolved from this machine's
    calibration (measured first where it is not cached); one line on stderr says the choice."""
    if "tree" not in auto and run.tree is not None:
        return run.k, run.tree  # a tree leaves k unused: nothing to calibrate
    from specdecode.auto.calibrate import calibrated
    from specdecode.auto.calibration import auto_setting

    assert run.target is not None and run.draft is not None
    calibration, path = calibrated(target, draft, run.target, run.draft)
    k, tree = auto_setting(calibration, "k" in auto, "tree" in auto, run.k, run.tree)
    chosen = next(
        c
        for c in (*calibration.tree_candidates(), *calibration.chains())
        if (c.tree == tree if tree is not None else c.tree is None and c.k == k)
    )
    print(
        f"auto: {chosen.label} (expected {chosen.tokens_per_s:.1f} tokens/s on this machine, "
        f"calibration {path}; `specdecode calibrate` shows it)",
        file=sys.stderr,
    )
    return k, tree
