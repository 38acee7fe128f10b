"""A calibration record: one machine's measured costs and acceptance for one target/draft pair,
and the chain k and tree shape they make fastest.

What is measured (calibrate.py measures it; nothing here reads a clock):
- t(n): the target's forward over n new tokens after a cached prefix, n = 1..MAX_ROWS (median of
  a few repeats after a warm-up); v(n) = t(n) / t(1), t_1 = t(1);
- d(n): the draft's forward over n new tokens the same way (a tree level of n nodes, a chain's
  catch-up); none for a model-free draft (prompt lookup: its cost is in the step overhead);
- a greedy chain run at k = `ChainRun.k` on a few bench-suite prompts: per-position acceptance
  (`accepted_at`, `drafted_at` over `steps`) and the step's time outside the two models'
  forwards, `step_overhead_s` (o);
- each candidate tree replayed (auto/replay.py) on that run's answers with the real draft: its
  steps, tokens emitted, the rows of every draft forward and of every verification.

How the defaults are chosen: each candidate's expected tokens per second = expected tokens per
step / expected seconds per step, the best one wins (ties: the earlier candidate, a chain before
a tree).
- chain of k (`expected_chain_step`): tokens = 1 + sum_{i<=k} P(L >= i) from the chain run's
  per-position acceptance; seconds = E[drafted]·d(1) + E[v(drafted + 1)]·t_1 + o;
- tree: tokens = what the replay emitted per step; seconds = the replay's draft forwards, each
  d(its rows), + v(verified rows)·t_1 + o per step.
So cost = draft forwards · draft seconds + v(nodes) · one-token seconds (+ the measured step
overhead), all from this machine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from specdecode.auto.costs import expected_chain_step
from specdecode.drafters.tree_shape import parse_tree_spec

FORMAT = 1  # the record's layout: a file of another format is ignored
MAX_ROWS = 16  # v(n) and d(n) are measured for n = 1..MAX_ROWS
MAX_TREE_NODES = MAX_ROWS - 1  # a candidate tree's verification (nodes + root) fits the table


@dataclass(frozen=True)
class MachineKey:
    """Everything a measured cost depends on besides the models: a cached calibration whose key
    differs in any field was measured elsewhere (or with other software) and is not used."""

    cpu: str  # the CPU's model name
    cpu_family: str
    cpu_model: str
    cpu_stepping: str
    flags: tuple[str, ...]  # which of calibrate.RELEVANT_FLAGS the CPU has, sorted
    threads: int  # torch.get_num_threads()
    device: str  # "cpu", or "cuda NAME"
    torch: str
    transformers: str
    specdecode: str
    target_kernel: str  # LoadedModel.kernel names (kernels/cpu.py), "eager" for PyTorch's
    draft_kernel: str  # "none" for a model-free draft
    draft_forward: str  # "lean" (lean.py), "hf" (the model's own) or "none"
    target_forward: str = "hf"  # "lean" (lean.target_cache) or "hf"
    format: int = FORMAT
    kernels: str = ""  # kernels.build.source_digest(): the kernels' code, between versions too
    draft_vocab: int = 0  # ids the draft's output layer computes (models/draft_vocab.py); 0: all

    def differences(self, other: MachineKey) -> list[str]:
        """The fields in which `other` differs from this key."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class ChainRun:
    """The chain run's raw counters (types.Stats over every prompt)."""

    k: int
    prompts: tuple[str, ...]  # ids of the bench-suite prompts (or "ids-N" for token-id prompts)
    new_tokens: int
    steps: int
    accepted_at: tuple[int, ...]  # steps that accepted position i (i = 1..k)
    drafted_at: tuple[int, ...]  # steps that drafted position i
    step_overhead_s: float  # (decode time - target and draft forward seconds) / steps

    @property
    def per_position_acceptance(self) -> list[float | None]:
        return [
            a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at, strict=True)
        ]

    def profile(self) -> dict[str, list[float]]:
        """P(L >= i) and P(D >= i), i = 1..k, over the run's step starts."""
        pad = [0] * (self.k - len(self.accepted_at))
        return {
            "p_accepted_ge": [a / self.steps for a in [*self.accepted_at, *pad]],
            "p_drafted_ge": [d / self.steps for d in [*self.drafted_at, *pad]],
        }


@dataclass(frozen=True)
class TreeRun:
    """One candidate tree replayed on the chain run's answers."""

    shape: str
    steps: int
    emitted: int
    draft_rows: dict[int, int]  # rows of a draft forward -> how many such forwards
    verify_rows: dict[int, int]  # rows of a verification (nodes + root) -> how many steps


@dataclass(frozen=True)
class Candidate:
    """A chain of k or a tree, with what the calibration expects of one step."""

    k: int | None
    tree: str | None
    tokens_per_step: float
    draft_forwards_per_step: float
    verified_per_step: float  # rows of the verification forward, the root included
    seconds_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds_per_step if self.seconds_per_step else 0.0

    @property
    def label(self) -> str:
        return f"tree {self.tree}" if self.tree is not None else f"chain k={self.k}"


@dataclass(frozen=True)
class Calibration:
    """One machine's calibration of one target/draft/dtype (module docstring); validated on
    construction (ValueError naming the field)."""

    machine: MachineKey
    target: str  # the spec as given, a folder made absolute; a `:int4` / `:int8` suffix kept
    draft: str
    dtype: str  # the target's loaded dtype, e.g. "bfloat16"
    target_forward_s: dict[int, float]  # t(n), n = 1..MAX_ROWS
    draft_forward_s: dict[int, float]  # d(n), n = 1..MAX_ROWS; {} for a model-free draft
    chain: ChainRun
    trees: tuple[TreeRun, ...] = ()
    prefix: int = 0  # the cached tokens t(n) and d(n) were measured after
    repeats: int = 0
    measured_at: str = ""  # local time, ISO 8601
    seconds: float = 0.0  # how long the calibration took
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def one_token_s(self) -> float:
        return self.target_forward_s[1]

    @property
    def v(self) -> dict[int, float]:
        """v(n) = t(n) / t(1)."""
        return {n: t / self.one_token_s for n, t in self.target_forward_s.items()}

    def draft_s(self, rows: int) -> float:
        """d(rows); 0 for a model-free draft."""
        return self.draft_forward_s.get(rows, 0.0) if self.draft_forward_s else 0.0

    def chains(self) -> list[Candidate]:
        """Every chain k = 1..chain.k (module docstring)."""
        profile, v = self.chain.profile(), self.v
        out = []
        for k in range(1, self.chain.k + 1):
            tokens, seconds = expected_chain_step(
                profile, k, v, self.draft_s(1), self.one_token_s, self.chain.step_overhead_s
            )
            drafted = sum(profile["p_drafted_ge"][:k])  # E[min(D, k)]
            out.append(Candidate(k, None, tokens, drafted, drafted + 1.0, seconds))
        return out

    def tree_candidates(self) -> list[Candidate]:
        """Every replayed tree (module docstring)."""
        out = []
        for run in self.trees:
            draft = sum(self.draft_s(n) * count for n, count in run.draft_rows.items())
            verify = sum(self.v[n] * count for n, count in run.verify_rows.items())
            seconds = draft + verify * self.one_token_s + run.steps * self.chain.step_overhead_s
            forwards = sum(run.draft_rows.values())
            rows = sum(n * count for n, count in run.verify_rows.items())
            per_step = [x / run.steps for x in (run.emitted, forwards, rows, seconds)]
            out.append(Candidate(None, run.shape, *per_step))
        return out

    def best_chain(self) -> Candidate:
        return _best(self.chains())

    def best_tree(self) -> Candidate | None:
        """None where no tree was calibrated (a model-free draft)."""
        trees = self.tree_candidates()
        return _best(trees) if trees else None

    def best(self) -> Candidate:
        """The fastest candidate, chain or tree."""
        tree = self.best_tree()
        chain = self.best_chain()
        return tree if tree is not None and tree.tokens_per_s > chain.tokens_per_s else chain

    def to_dict(self) -> dict[str, Any]:
        """The JSON record; "chosen" is derived (written for reading, recomputed on load)."""
        data = dataclasses.asdict(self)
        data["format"] = self.machine.format
        best_tree = self.best_tree()
        data["chosen"] = {
            "k": self.best_chain().k,
            "tree": best_tree.tree if best_tree else None,
            "best": self.best().label,
        }
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Calibration:
        """A record written by `to_dict`; ValueError for anything else (the cache ignores it)."""
        if not isinstance(data, dict):
            raise ValueError("a calibration is a JSON object")
        try:
            machine = data["machine"]
            chain = data["chain"]
            return cls(
                machine=MachineKey(**{**machine, "flags": tuple(machine["flags"])}),
                target=data["target"],
                draft=data["draft"],
                dtype=data["dtype"],
                target_forward_s=_int_keys(data["target_forward_s"], "target_forward_s"),
                draft_forward_s=_int_keys(data["draft_forward_s"], "draft_forward_s"),
                chain=ChainRun(
                    **{
                        **chain,
                        "prompts": tuple(chain["prompts"]),
                        "accepted_at": tuple(chain["accepted_at"]),
                        "drafted_at": tuple(chain["drafted_at"]),
                    }
                ),
                trees=tuple(
                    TreeRun(
                        **{
                            **tree,
                            "draft_rows": _int_keys(tree["draft_rows"], "draft_rows"),
                            "verify_rows": _int_keys(tree["verify_rows"], "verify_rows"),
                        }
                    )
                    for tree in data["trees"]
                ),
                prefix=data["prefix"],
                repeats=data["repeats"],
                measured_at=data["measured_at"],
                seconds=data["seconds"],
                extra=data.get("extra", {}),
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a calibration record ({type(err).__name__}: {err})") from None


def auto_setting(
    calibration: Calibration, k_auto: bool, tree_auto: bool, k: int, tree: str | None
) -> tuple[int, str | None]:
    """(k, tree) once `auto` is resolved from `calibration`:
    - tree and k auto: the fastest candidate (a tree, or a chain with its k);
    - tree auto: the fastest tree (k as given, unused by a tree); ValueError without one;
    - k auto: with no tree, the fastest chain's k; with a tree, k is unused and stays as given.
    """
    if tree_auto:
        best = calibration.best() if k_auto else calibration.best_tree()
        if best is None:
            raise ValueError(
                f"--tree auto: the calibration of draft {calibration.draft} has no tree (a "
                "model-free draft drafts no tree)"
            )
        return (k, best.tree) if best.tree is not None else (best.k or k, None)
    if k_auto and tree is None:
        return calibration.best_chain().k or k, None
    return k, tree


def _best(candidates: list[Candidate]) -> Candidate:
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate.tokens_per_s > best.tokens_per_s:
            best = candidate
    return best


def _int_keys(table: Any, name: str) -> dict[int, Any]:
    """JSON's string keys back to ints."""
    if not isinstance(table, dict):
        raise ValueError(f"{name} must be an object (got {type(table).__name__})")
    try:
        return {int(n): value for n, value in table.items()}
    except ValueError:
        raise ValueError(f"{name} has a key that is not an integer: {list(table)}") from None


# -- validation ------------------------------------------------------------------------------


def _positive(value: Any, name: str, zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound} (got {value!r})")


def _count(value: Any, name: str, least: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least} (got {value!r})")


def _string(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string (got {value!r})")


def _times(table: dict[int, float], name: str, empty: bool = False) -> None:
    if empty and not table:
        return
    if sorted(table) != list(range(1, MAX_ROWS + 1)):
        raise ValueError(f"{name} must hold n = 1..{MAX_ROWS} (got {sorted(table)})")
    for n, seconds in table.items():
        _positive(seconds, f"{name}[{n}]")


def _rows(table: dict[int, int], name: str) -> None:
    for n, count in table.items():
        if not 1 <= n <= MAX_ROWS:
            raise ValueError(f"{name}: {n} rows is outside 1..{MAX_ROWS}")
        _count(count, f"{name}[{n}]")


def _check(c: Calibration) -> None:
    if not isinstance(c.machine, MachineKey):
        raise ValueError("machine must be a MachineKey")
    for f in dataclasses.fields(MachineKey):
        value = getattr(c.machine, f.name)
        if f.name in ("threads", "format", "draft_vocab"):
            _count(value, f"machine.{f.name}", 0 if f.name == "draft_vocab" else 1)
        elif f.name == "flags":
            if not all(isinstance(flag, str) for flag in value):
                raise ValueError(f"machine.flags must be strings (got {value!r})")
        else:
            _string(value, f"machine.{f.name}")
    for name in ("target", "draft", "dtype", "measured_at"):
        _string(getattr(c, name), name)
    _times(c.target_forward_s, "target_forward_s")
    _times(c.draft_forward_s, "draft_forward_s", empty=True)
    _count(c.prefix, "prefix")
    _count(c.repeats, "repeats")
    _positive(c.seconds, "seconds", zero=True)
    if not isinstance(c.extra, dict):
        raise ValueError("extra must be an object")
    chain = c.chain
    _count(chain.k, "chain.k", 1)
    _count(chain.steps, "chain.steps", 1)
    _count(chain.new_tokens, "chain.new_tokens", 1)
    _positive(chain.step_overhead_s, "chain.step_overhead_s", zero=True)
    if not all(isinstance(p, str) for p in chain.prompts):
        raise ValueError("chain.prompts must be strings")
    if len(chain.accepted_at) != len(chain.drafted_at) or len(chain.drafted_at) > chain.k:
        raise ValueError("chain.accepted_at and chain.drafted_at need one count per position <= k")
    for i, (a, d) in enumerate(zip(chain.accepted_at, chain.drafted_at, strict=True)):
        _count(a, f"chain.accepted_at[{i}]")
        _count(d, f"chain.drafted_at[{i}]")
        if not a <= d <= chain.steps:
            raise ValueError(f"position {i + 1}: accepted {a} <= drafted {d} <= steps fails")
    for tree in c.trees:
        if not isinstance(tree, TreeRun):
            raise ValueError("trees must be TreeRun records")
        _string(tree.shape, "trees[].shape")
        parse_tree_spec(tree.shape)
        _count(tree.steps, f"tree {tree.shape} steps", 1)
        _count(tree.emitted, f"tree {tree.shape} emitted", tree.steps)
        _rows(tree.draft_rows, f"tree {tree.shape} draft_rows")
        _rows(tree.verify_rows, f"tree {tree.shape} verify_rows")
        if sum(tree.verify_rows.values()) != tree.steps:
            raise ValueError(f"tree {tree.shape}: one verification per step")
        if tree.draft_rows and not c.draft_forward_s:
            raise ValueError(f"tree {tree.shape}: draft forwards without measured draft costs")
