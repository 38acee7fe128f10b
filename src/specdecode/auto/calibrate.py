"""This machine's calibration of a target/draft pair: measured once, cached, and read by `demo`,
`generate --k auto / --tree auto` and `serve` to pick k or the tree shape.

`measure` takes the measurements calibration.py describes (its docstring says how the defaults
are chosen from them): the target's and the draft's forwards over 1..16 new tokens after a cached
prefix (auto/costs.py, median of `REPEATS` rounds over every size after a warm-up round), a
greedy chain run at k = `CHAIN_K` on the first prompt of each of `PROMPT_CATEGORIES` (its
per-position acceptance and step overhead; its answers are the target's greedy output), and
every tree of `TREE_CANDIDATES` replayed on those answers with the real draft (auto/replay.py:
draft forwards only).

`calibrated` reads the cache first: one JSON file per key in the folder `CACHE_FOLDER` of the
specdecode cache dir (models/fetch.py `cache_dir`), named by a hash of the machine key (CPU
model, family, model, stepping and flags, torch threads, the device, torch, transformers and
specdecode versions, the kernels and draft forward in use, the record's format) with the target,
draft and dtype. A file that does not parse, or whose key or models differ from this process's
(copied from another machine, or older software), is ignored with one line on stderr and
measured again, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

import specdecode
from specdecode.auto.calibration import (
    MAX_ROWS,
    MAX_TREE_NODES,
    Calibration,
    ChainRun,
    MachineKey,
    TreeRun,
)
from specdecode.auto.costs import forward_seconds
from specdecode.auto.replay import replay
from specdecode.core.cache import KVCache
from specdecode.core.draft_spec import DraftSpec, ModelSpec
from specdecode.core.measure import clock_for
from specdecode.data.suites import load_suite
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.tree_shape import parse_tree_spec
from specdecode.kernels.build import source_digest
from specdecode.kernels.cpu import cpu_flags
from specdecode.models.compat import context_length
from specdecode.models.draft_vocab import kept_count
from specdecode.models.fetch import cache_dir
from specdecode.models.lean import draft_cache, runs_lean, target_cache
from specdecode.models.loading import LoadedModel
from specdecode.runtime.engine import SpeculativeDecoder

RELEVANT_FLAGS = ("avx2", "avx512_bf16", "avx512_vnni", "avx512f", "fma")
CHAIN_K = 8  # the chain run's k: every chain k = 1..CHAIN_K is predicted from it
PREFIX = 128  # cached tokens before the timed forwards
REPEATS = 3  # timed rounds over every size (after a warm-up round), each size's median kept
MAX_NEW_TOKENS = 48  # per calibration prompt
# the first prompt of each; short ones (summarization and extraction prompts run to ~1000
# characters, whose prefill would cost more than the rest), acceptance from high to lower
PROMPT_CATEGORIES = ("code_generation", "chat", "math_reasoning")
# at most MAX_TREE_NODES nodes, so that a verification fits the measured v(n): shapes the
# benchmarks and lab notes ran (the fastest ones on AVX2 and on AVX-512 BF16 among them,
# docs/results.md), and a larger one of the same family; chains cover the small end
TREE_CANDIDATES = (
    "dynamic:5,6,2,0.3",
    "dynamic:8,6,2,0.2",
    "dynamic:11,6,3,0.2",
    "dynamic:11,8,3,0.2,0.05",
    "dynamic:15,8,3,0.2,0.05",
)

CACHE_FOLDER = "machine-calibration"  # under the specdecode cache dir
_NOTED: set[str] = set()  # cache files already reported as ignored in this process


# -- keys ------------------------------------------------------------------------------------


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first CPU's model name, family, model and stepping (Linux /proc/cpuinfo; elsewhere
    the model name from `platform` and empty fields)."""
    wanted = {"model name": "", "cpu family": "", "model": "", "stepping": ""}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip() and any(wanted.values()):
                    break  # the first processor's block is enough
                name, _, value = line.partition(":")
                if name.strip() in wanted and not wanted[name.strip()]:
                    wanted[name.strip()] = value.strip()
    except OSError:
        pass
    wanted["model name"] = wanted["model name"] or platform.processor() or platform.machine()
    return wanted


def _draft_parts(draft: Any, target: LoadedModel) -> tuple[Any, str]:
    """(the draft's model or None, the kernel its linears run on) for what `resolve_draft`
    returns: a LoadedModel, an early-exit drafter (the target's own layers) or a model-free one."""
    if isinstance(draft, LoadedModel):
        return draft.model, draft.kernel
    if isinstance(draft, ModelDrafter):
        return draft.model, target.kernel  # early exit shares the target's weights
    if hasattr(draft, "propose") or hasattr(draft, "propose_tree"):
        return None, "none"
    return draft, "eager"  # a transformers model, as SpeculativeDecoder takes it


def machine_key(target: LoadedModel, draft: Any) -> MachineKey:
    """This process's key for a calibration of `target` with `draft` (as `resolve_draft` gives)."""
    cpu = cpu_identity()
    device = target.device
    where = "cpu" if device.type == "cpu" else f"{device.type} {torch.cuda.get_device_name(device)}"
    draft_model, draft_kernel = _draft_parts(draft, target)
    forward = "none" if draft_model is None else "lean" if runs_lean(draft_model) else "hf"
    return MachineKey(
        cpu=cpu["model name"],
        cpu_family=cpu["cpu family"],
        cpu_model=cpu["model"],
        cpu_stepping=cpu["stepping"],
        flags=tuple(sorted(set(RELEVANT_FLAGS) & cpu_flags())),
        threads=torch.get_num_threads(),
        device=where,
        torch=torch.__version__,
        transformers=transformers.__version__,
        specdecode=specdecode.__version__,
        target_kernel=target.kernel,
        draft_kernel=draft_kernel,
        draft_forward=forward,
        target_forward="hf" if isinstance(target_cache(target.model), KVCache) else "lean",
        kernels=source_digest(),
        draft_vocab=(kept_count(draft_model) or 0) if draft_model is not None else 0,
    )


def _absolute(name: str) -> str:
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def canonical_target(name: str) -> str:
    """The target's spec as the cache keys it: a local folder or file made absolute, a
    quantization suffix kept."""
    spec = ModelSpec.parse(name, "target")
    return str(ModelSpec(_absolute(spec.name), spec.quantization))


def canonical_draft(name: str) -> str:
    """The draft's spec as the cache keys it (DraftSpec's text, a local model made absolute)."""
    spec = DraftSpec.parse(name)
    if spec.model is None:
        return str(spec)
    model = str(ModelSpec(_absolute(spec.model.name), spec.model.quantization))
    if spec.kind == "distilled":  # the adapter's hash too: a new distillation in DIR is a new draft
        return f"distilled:{model}@{_adapter_hash(spec.model.name)}"
    if spec.kind == "eagle":  # the same for a head: its weights' hash (trained here) or size
        return f"eagle3:{model}@{_head_identity(spec.model.name)}"
    return model


def _head_identity(folder: str) -> str:
    """An EAGLE-3 head's weights: their hash in DIR/eagle.json for a head trained here, else
    (a published head) the weights file's size and time, without reading a gigabyte."""
    trained = _adapter_hash(folder, "eagle.json", ("sha256",))
    if trained != "unfinished":
        return trained
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = Path(folder).expanduser() / name
        if path.is_file():
            stat = path.stat()
            return f"{stat.st_size}-{stat.st_mtime_ns}"
    return "unfinished"


def _adapter_hash(
    folder: str, record_file: str = "distill.json", path: tuple[str, ...] = ("adapter", "sha256")
) -> str:
    """The start of a trained folder's weights hash (a distillation's adapter in
    DIR/distill.json; a head's in DIR/eagle.json), or "unfinished"."""
    try:
        value: Any = json.loads((Path(folder).expanduser() / record_file).read_text())
        for key in path:
            value = value[key]
        return str(value)[:16]
    except (OSError, ValueError, KeyError, TypeError):
        return "unfinished"


def cache_path(
    key: MachineKey, target: str, draft: str, dtype: str, root: Path | None = None
) -> Path:
    """`root` (default: the specdecode cache dir)/machine-calibration/HASH.json for this key and
    pair (names as `canonical_target` / `canonical_draft` give them)."""
    blob = json.dumps(
        {"machine": asdict(key), "target": target, "draft": draft, "dtype": dtype}, sort_keys=True
    )
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return (root if root is not None else cache_dir()) / CACHE_FOLDER / f"{digest}.json"


# -- the cache -------------------------------------------------------------------------------


def _note_once(path: Path, why: str) -> None:
    if str(path) not in _NOTED:
        _NOTED.add(str(path))
        print(f"note: ignoring the calibration in {path}: {why}", file=sys.stderr)


def load_calibration(
    path: Path, key: MachineKey, target: str, draft: str, dtype: str
) -> Calibration | None:
    """The calibration in `path` if it is one of this key and pair; None otherwise (a missing
    file silently; a corrupt one, or one measured elsewhere, with a note on stderr, once)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        _note_once(path, f"unreadable ({err.strerror})")
        return None
    try:
        calibration = Calibration.from_dict(json.loads(text))
    except ValueError as err:  # json.JSONDecodeError is one
        _note_once(path, f"not a valid calibration record ({err})")
        return None
    differs = calibration.machine.differences(key)
    if differs:
        _note_once(
            path,
            f"measured on another machine or with other software (differs in {', '.join(differs)})",
        )
        return None
    pair = (calibration.target, calibration.draft, calibration.dtype)
    if pair != (target, draft, dtype):
        _note_once(path, f"it calibrates {'/'.join(pair)}, not {target}/{draft}/{dtype}")
        return None
    return calibration


def save_calibration(calibration: Calibration, path: Path) -> None:
    """Write `calibration` to `path` atomically (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users of a shared cache
        with os.fdopen(fd, "w") as f:
            json.dump(calibration.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def calibrated(
    target: LoadedModel,
    draft: Any,
    target_name: str,
    draft_name: str,
    *,
    force: bool = False,
    progress: bool = True,
    **options: Any,
) -> tuple[Calibration, Path]:
    """This machine's calibration of `target` (a LoadedModel) with `draft` (what
    `resolve_draft(draft_name, ...)` gave), and its cache file: read from the cache unless
    `force`, else measured (`measure(..., **options)`, with a line on stderr) and saved."""
    key = machine_key(target, draft)
    names = canonical_target(target_name), canonical_draft(draft_name)
    dtype = str(target.dtype).removeprefix("torch.")
    path = cache_path(key, *names, dtype)
    if not force:
        cached = load_calibration(path, key, *names, dtype)
        if cached is not None:
            return cached, path
    print(
        f"calibrating {names[0]} with draft {names[1]} ({dtype}) on this machine: forward costs "
        f"and a short greedy run, once (cached in {path})",
        file=sys.stderr,
    )
    start = time.perf_counter()
    calibration = measure(target, draft, *names, progress=progress, **options)
    save_calibration(calibration, path)
    print(f"calibrated in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return calibration, path


# -- measuring -------------------------------------------------------------------------------


def _check_candidate(shape: str) -> str:
    """A candidate tree whose verifications and draft forwards fit the measured 1..MAX_ROWS."""
    tree = parse_tree_spec(shape)
    if tree.dynamic:
        nodes, widest = tree.nodes, tree.width
    else:
        nodes, level, widest = 0, 1, 0
        for children in tree.branching:
            widest = max(widest, level)  # a level's nodes are fed in one draft forward
            level *= children
            nodes += level
    if nodes > MAX_TREE_NODES or widest > MAX_ROWS or tree.max_depth > MAX_TREE_NODES:
        raise ValueError(
            f"candidate tree {shape}: at most {MAX_TREE_NODES} nodes and {MAX_ROWS} per level "
            f"(costs are measured for 1..{MAX_ROWS} tokens)"
        )
    return shape


def calibration_prompts(engine: SpeculativeDecoder) -> list[tuple[str, list[int]]]:
    """(id, prompt ids): the first bench-suite prompt of each of PROMPT_CATEGORIES, in the chat
    template where the tokenizer has one; a model without a tokenizer gets seeded random ids."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        vocab = engine.target.model.get_input_embeddings().num_embeddings
        gen = torch.Generator().manual_seed(0)
        return [
            (f"ids-{i + 1}", torch.randint(0, vocab, (24,), generator=gen).tolist())
            for i in range(len(PROMPT_CATEGORIES))
        ]
    chat = getattr(tokenizer, "chat_template", None) is not None
    prompts = load_suite(categories=PROMPT_CATEGORIES, limit=1)
    return [(p.id, engine.encode_prompt(p.turns[0], chat=chat)) for p in prompts]


def measure(
    target: LoadedModel,
    draft: Any,
    target_name: str,
    draft_name: str,
    *,
    prompts: Sequence[tuple[str, list[int]]] | None = None,
    trees: Sequence[str] = TREE_CANDIDATES,
    chain_k: int = CHAIN_K,
    max_new_tokens: int = MAX_NEW_TOKENS,
    repeats: int = REPEATS,
    prefix: int = PREFIX,
    progress: bool = True,
) -> Calibration:
    """Measure a Calibration (module docstring) of `target` with `draft`; greedy throughout.
    `prompts`: (id, prompt ids), default `calibration_prompts`. A model-free draft calibrates
    chains only."""
    start = time.perf_counter()
    key = machine_key(target, draft)
    chain = SpeculativeDecoder(target, draft, k=chain_k, k_policy="fixed", generation_config="none")
    draft_model = getattr(chain.drafter, "model", None)  # None: a model-free draft
    shapes = [_check_candidate(s) for s in trees] if draft_model is not None else []
    prompts = list(prompts) if prompts is not None else calibration_prompts(chain)
    models = [target.model] + ([draft_model] if draft_model is not None else [])
    contexts = [n for n in map(context_length, models) if n is not None]
    prefix = max(1, min([prefix, *(n - MAX_ROWS for n in contexts)]))
    clock = clock_for(target.device)
    sizes = range(1, MAX_ROWS + 1)
    total = MAX_ROWS * (repeats + 1) * len(models) + len(prompts) * (1 + len(shapes))
    with tqdm(
        total=total, desc="calibrate", unit="step", disable=not progress, file=sys.stderr
    ) as bar:

        def done(_: int) -> None:
            bar.update()

        bar.set_postfix_str("target forwards")
        target_s = forward_seconds(
            target.model, sizes, prefix, repeats, clock, cache_type=target_cache, done=done
        )
        draft_s: dict[int, float] = {}
        if draft_model is not None:
            bar.set_postfix_str("draft forwards")
            draft_s = forward_seconds(
                draft_model, sizes, prefix, repeats, clock, cache_type=draft_cache, done=done
            )
        bar.set_postfix_str(f"chain k={chain_k}")
        chain_run, answers = _chain_run(chain, prompts, max_new_tokens, done)
        tree_runs = []
        for shape in shapes:
            bar.set_postfix_str(f"tree {shape}")
            tree_runs.append(_tree_run(target, draft, shape, answers, done))
    return Calibration(
        machine=key,
        target=target_name,
        draft=draft_name,
        dtype=str(target.dtype).removeprefix("torch."),
        target_forward_s=target_s,
        draft_forward_s=draft_s,
        chain=chain_run,
        trees=tuple(tree_runs),
        prefix=prefix,
        repeats=repeats,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        seconds=time.perf_counter() - start,
    )


def _chain_run(
    engine: SpeculativeDecoder,
    prompts: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    done: Any,
) -> tuple[ChainRun, list[tuple[list[int], list[int]]]]:
    """The chain run's counters and (prompt ids, answer) per prompt."""
    if not prompts:
        raise ValueError("the calibration needs at least one prompt")
    # a short untimed generation first: first-call costs stay out of the step overhead
    engine.generate(prompts[0][1][:8], max_new_tokens=4, temperature=0.0)
    stats, answers = [], []
    for _, ids in prompts:
        result = engine.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
        stats.append(result.stats)
        answers.append((list(ids), result.token_ids))
        done(0)
    steps = sum(s.steps for s in stats)
    if steps == 0:
        raise ValueError("the calibration's chain run took no step (answers of one token)")
    k = engine.k
    accepted_at, drafted_at = [0] * k, [0] * k
    for s in stats:
        for i, (a, d) in enumerate(zip(s.accepted_at, s.drafted_at, strict=True)):
            accepted_at[i] += a
            drafted_at[i] += d
    decode = sum(s.wall_time_s - s.prefill_s for s in stats)
    forwards = sum(
        s.meter.seconds.get("target", 0.0) + s.meter.seconds.get("draft", 0.0) for s in stats
    )
    run = ChainRun(
        k=k,
        prompts=tuple(pid for pid, _ in prompts),
        new_tokens=sum(s.new_tokens for s in stats),
        steps=steps,
        accepted_at=tuple(accepted_at),
        drafted_at=tuple(drafted_at),
        step_overhead_s=max(0.0, (decode - forwards) / steps),
    )
    return run, answers


def _tree_run(
    target: LoadedModel,
    draft: Any,
    shape: str,
    answers: list[tuple[list[int], list[int]]],
    done: Any,
) -> TreeRun:
    """`shape` replayed on every answer (auto/replay.py)."""
    engine = SpeculativeDecoder(target, draft, tree=shape, generation_config="none")
    steps = emitted = 0
    draft_rows: Counter[int] = Counter()
    verify_rows: Counter[int] = Counter()
    for ids, answer in answers:
        for n_emitted, rows, verified in replay(engine, ids, answer, 1):
            steps += 1
            emitted += n_emitted
            draft_rows.update(rows)
            verify_rows[verified] += 1
        done(0)
    return TreeRun(
        shape=shape,
        steps=steps,
        emitted=emitted,
        draft_rows=dict(sorted(draft_rows.items())),
        verify_rows=dict(sorted(verify_rows.items())),
    )
