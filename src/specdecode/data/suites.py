"""Prompt suites for the benchmark lab: the built-in suite, user files, and their ordering.

A suite is a JSON Lines file, one prompt per line, in either of two formats:
- ours: `{"id": "chat-01", "category": "chat", "prompt": "..."}`, or `"turns": ["...", "..."]` in
  place of `"prompt"` for a multi-turn conversation (the user messages, in order);
- Spec-Bench's: `{"question_id": 81, "category": "writing", "turns": ["..."]}` (the id becomes
  `"81"`).
Keys other than these are ignored. Blank lines are skipped. Ids are unique within a file.

The built-in suite (`prompts/suite.jsonl`) holds 8 prompts for each of `CATEGORIES`, written for
this project.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

CATEGORIES: tuple[str, ...] = (
    "code_generation",
    "code_editing",
    "chat",
    "creative_writing",
    "summarization",
    "translation",
    "question_answering",
    "math_reasoning",
    "extraction_rag",
)

_BUILTIN_PACKAGE = "specdecode.data.prompts"
_BUILTIN_FILE = "suite.jsonl"


@dataclass
class BenchPrompt:
    """One benchmark prompt: the user turns of a conversation (one turn for a single prompt)."""

    id: str
    category: str
    turns: list[str]


# what a benchmark warms up on: no prompt of any suite, so that a drafter that learns across
# requests (a suffix pool) has seen nothing of what it is then measured on
WARM_UP = BenchPrompt("warm-up", "warm-up", ["Write one short sentence about the sea."])
WARM_UP_TOKENS = 8


def load_suite(
    path: str | Path | None = None,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
) -> list[BenchPrompt]:
    """The prompts of a suite file (None: the built-in suite), in file order.

    `categories` keeps only those categories (each must occur in the file); `limit` keeps at most
    that many prompts per category, the first ones in file order. Raises ValueError naming the
    file (and line) for a missing or malformed file, and when nothing is left.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of prompts per category (got {limit!r})")
    name, text = _read(path)
    prompts = _parse(name, text)
    if not prompts:
        raise ValueError(f"{name}: no prompts in the file")

    if categories is not None:
        wanted = [categories] if isinstance(categories, str) else list(categories)
        available = list(dict.fromkeys(p.category for p in prompts))
        unknown = [c for c in wanted if c not in available]
        if unknown:
            raise ValueError(
                f"{name}: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                f"{', '.join(map(repr, unknown))}; available: {', '.join(available)}"
            )
        keep = set(wanted)
        prompts = [p for p in prompts if p.category in keep]

    if limit is not None:
        taken: dict[str, int] = {}
        kept = []
        for p in prompts:
            if taken.get(p.category, 0) < limit:
                taken[p.category] = taken.get(p.category, 0) + 1
                kept.append(p)
        prompts = kept

    if not prompts:
        raise ValueError(f"{name}: no prompts left after filtering (categories={categories!r})")
    return prompts


def interleave_by_category(prompts: Iterable[BenchPrompt]) -> list[BenchPrompt]:
    """Round-robin over categories (in order of first appearance), file order within each.

    The first prompt of every category, then the second of every category, and so on, so that a
    short or interrupted run still visits every category.
    """
    by_category: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    queues = list(by_category.values())
    ordered: list[BenchPrompt] = []
    for i in range(max((len(q) for q in queues), default=0)):
        ordered.extend(q[i] for q in queues if i < len(q))
    return ordered


def _read(path: str | Path | None) -> tuple[str, str]:
    """(a name for messages, the file's text)."""
    if path is None:
        resource = resources.files(_BUILTIN_PACKAGE).joinpath(_BUILTIN_FILE)
        return f"built-in suite {_BUILTIN_FILE}", resource.read_text(encoding="utf-8")
    file = Path(path)
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "not found"
        raise ValueError(f"prompt suite {file}: {what}")
    try:
        return str(file), file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt suite {file}: not UTF-8 text ({e})") from e


def _parse(name: str, text: str) -> list[BenchPrompt]:
    prompts: list[BenchPrompt] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompt = _prompt_from(obj, where)
        if prompt.id in first_line:
            raise ValueError(
                f"{where}: duplicate id {prompt.id!r} (first used on line {first_line[prompt.id]})"
            )
        first_line[prompt.id] = lineno
        prompts.append(prompt)
    return prompts


def _prompt_from(obj: dict[str, Any], where: str) -> BenchPrompt:
    key = "id" if "id" in obj else "question_id"
    raw_id = obj.get(key)
    if raw_id is None:
        raise ValueError(f"{where}: missing 'id' (or Spec-Bench 'question_id')")
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int):
        raise ValueError(f"{where}: {key!r} must be a string or an integer, got {raw_id!r}")
    prompt_id = str(raw_id).strip()
    if not prompt_id:
        raise ValueError(f"{where}: empty {key!r}")

    category = obj.get("category")
    if category is None:
        raise ValueError(f"{where}: missing 'category'")
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")

    has_prompt, has_turns = "prompt" in obj, "turns" in obj
    if has_prompt and has_turns:
        raise ValueError(f"{where}: has both 'prompt' and 'turns'; give one of them")
    if has_prompt:
        text = obj["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"{where}: empty 'prompt'")
        turns = [text]
    elif has_turns:
        turns = obj["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a list of strings")
        if not turns:
            raise ValueError(f"{where}: empty 'turns'")
        empty = [i + 1 for i, t in enumerate(turns) if not t.strip()]
        if empty:
            raise ValueError(f"{where}: empty turn(s) {empty} in 'turns'")
        turns = list(turns)
    else:
        raise ValueError(f"{where}: neither 'prompt' nor 'turns'")
    return BenchPrompt(id=prompt_id, category=category, turns=turns)
