"""Prompt suites: the built-in suite's content, both file formats, filters and every error."""

from __future__ import annotations

import json
import re
from collections import Counter
from importlib import resources

import pytest

from specdecode.data.suites import (
    CATEGORIES,
    BenchPrompt,
    interleave_by_category,
    load_suite,
)


def write_jsonl(path, rows) -> str:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def source_text(prompt: str) -> str:
    """The quoted source text (between triple quotes) that a summarization/extraction prompt holds."""
    match = re.search(r'"""\n(.*?)\n"""', prompt, re.DOTALL)
    assert match, f"no quoted source text in {prompt[:60]!r}"
    return match.group(1)


# ----- the built-in suite -----


def test_builtin_suite_is_package_data():
    names = [f.name for f in resources.files("specdecode.data.prompts").iterdir()]
    assert "suite.jsonl" in names


def test_builtin_suite_has_every_category():
    prompts = load_suite()
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(CATEGORIES)
    assert all(counts[c] >= 8 for c in CATEGORIES), counts
    assert len(CATEGORIES) == 9
    # file order follows CATEGORIES
    assert list(dict.fromkeys(p.category for p in prompts)) == list(CATEGORIES)


def test_builtin_suite_ids_unique_and_strings_nonempty():
    prompts = load_suite()
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids))
    for p in prompts:
        assert isinstance(p, BenchPrompt)
        assert p.id.strip() and p.category.strip()
        assert p.turns and all(isinstance(t, str) and t.strip() for t in p.turns)


def test_builtin_chat_prompts_are_multi_turn():
    chats = [p for p in load_suite() if p.category == "chat"]
    assert chats and all(len(p.turns) >= 2 for p in chats)
    others = [p for p in load_suite() if p.category != "chat"]
    assert all(len(p.turns) == 1 for p in others)


@pytest.mark.parametrize("category", ["summarization", "extraction_rag"])
def test_builtin_sources_are_long_enough(category):
    for p in load_suite(categories=[category]):
        words = len(source_text(p.turns[0]).split())
        assert words >= 100, (p.id, words)


def test_builtin_code_editing_prompts_include_code():
    for p in load_suite(categories=["code_editing"]):
        assert re.search(r"```\w+\n.+\n```", p.turns[0], re.DOTALL), p.id


def test_builtin_prompts_stay_short():
    # a rough upper bound on tokens: words and punctuation marks, each counted once
    for p in load_suite():
        pieces = sum(len(re.findall(r"\w+|[^\w\s]", t)) for t in p.turns)
        assert pieces < 350, (p.id, pieces)


# ----- file formats -----


def test_spec_bench_format(tmp_path):
    path = write_jsonl(
        tmp_path / "question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            {"question_id": 82, "category": "qa", "turns": ["Why?"], "reference": ["x"]},
            {"question_id": "q3", "category": "qa", "turns": ["How?"], "extra": {"a": 1}},
        ],
    )
    prompts = load_suite(path)
    assert prompts == [
        BenchPrompt("81", "writing", ["Write a poem.", "Shorter."]),
        BenchPrompt("82", "qa", ["Why?"]),
        BenchPrompt("q3", "qa", ["How?"]),
    ]


def test_our_format_from_file(tmp_path):
    path = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"id": "a-1", "category": "a", "prompt": "Hello there."},
            "",
            {"id": "b-1", "category": "b", "turns": ["One.", "Two.", "Three."], "note": "ignored"},
        ],
    )
    assert load_suite(tmp_path / "mine.jsonl") == load_suite(path)
    assert load_suite(path) == [
        BenchPrompt("a-1", "a", ["Hello there."]),
        BenchPrompt("b-1", "b", ["One.", "Two.", "Three."]),
    ]


# ----- filters -----


@pytest.fixture
def mixed(tmp_path):
    rows = [
        {"id": f"{cat}-{i}", "category": cat, "prompt": f"{cat} prompt {i}"}
        for cat, n in (("x", 3), ("y", 1), ("z", 2))
        for i in range(n)
    ]
    rows.insert(1, {"id": "y-late", "category": "y", "prompt": "y again"})  # categories mixed up
    return write_jsonl(tmp_path / "mixed.jsonl", rows)


def ids(prompts):
    return [p.id for p in prompts]


def test_categories_filter_keeps_file_order(mixed):
    assert ids(load_suite(mixed, categories=["z", "y"])) == ["y-late", "y-0", "z-0", "z-1"]
    assert ids(load_suite(mixed, categories="z")) == ["z-0", "z-1"]


def test_limit_per_category_keeps_first(mixed):
    assert ids(load_suite(mixed, limit=1)) == ["x-0", "y-late", "z-0"]
    assert ids(load_suite(mixed, categories=["x"], limit=2)) == ["x-0", "x-1"]
    assert len(load_suite(mixed, limit=100)) == 7


def test_builtin_limit():
    prompts = load_suite(limit=2)
    assert len(prompts) == 2 * len(CATEGORIES)
    assert Counter(p.category for p in prompts) == dict.fromkeys(CATEGORIES, 2)
    chosen = load_suite(categories=["chat", "translation"], limit=1)
    assert ids(chosen) == ["chat-01", "translation-01"]


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_bad_limit(mixed, limit):
    with pytest.raises(ValueError, match="limit must be a positive"):
        load_suite(mixed, limit=limit)


def test_unknown_category_lists_available(mixed):
    with pytest.raises(ValueError, match=r"unknown category 'nope'; available: x, y, z") as e:
        load_suite(mixed, categories=["x", "nope"])
    assert "mixed.jsonl" in str(e.value)
    with pytest.raises(ValueError, match=r"available: code_generation, code_editing, chat"):
        load_suite(categories=["writing"])


def test_empty_category_list_is_an_error(mixed):
    with pytest.raises(ValueError, match="no prompts left"):
        load_suite(mixed, categories=[])


# ----- round-robin ordering -----


def test_interleave_round_robin(mixed):
    order = ids(interleave_by_category(load_suite(mixed)))
    assert order == ["x-0", "y-late", "z-0", "x-1", "y-0", "z-1", "x-2"]


def test_interleave_builtin_visits_every_category_first():
    order = interleave_by_category(load_suite())
    assert [p.category for p in order[: len(CATEGORIES)]] == list(CATEGORIES)
    assert sorted(ids(order)) == sorted(ids(load_suite()))
    assert interleave_by_category([]) == []


# ----- errors -----


GOOD = {"id": "ok", "category": "c", "prompt": "fine"}


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"id": "a", "category": "c", "prompt": "x"', "invalid JSON"),
        ('["not", "an", "object"]', "expected a JSON object, got list"),
        ({"id": "a", "prompt": "x"}, "missing 'category'"),
        ({"id": "a", "category": "", "prompt": "x"}, "'category' must be a non-empty string"),
        ({"id": "a", "category": "c"}, "neither 'prompt' nor 'turns'"),
        ({"id": "a", "category": "c", "prompt": "x", "turns": ["y"]}, "both 'prompt' and 'turns'"),
        ({"id": "a", "category": "c", "prompt": "   "}, "empty 'prompt'"),
        ({"id": "a", "category": "c", "prompt": 3}, "'prompt' must be a string"),
        ({"id": "a", "category": "c", "turns": []}, "empty 'turns'"),
        ({"id": "a", "category": "c", "turns": ["x", ""]}, r"empty turn\(s\) \[2\]"),
        ({"id": "a", "category": "c", "turns": "x"}, "'turns' must be a list of strings"),
        ({"id": "a", "category": "c", "turns": ["x", 2]}, "'turns' must be a list of strings"),
        ({"category": "c", "prompt": "x"}, "missing 'id'"),
        ({"id": "", "category": "c", "prompt": "x"}, "empty 'id'"),
        ({"id": [1], "category": "c", "prompt": "x"}, "'id' must be a string or an integer"),
        (
            {"id": "ok", "category": "c", "prompt": "x"},
            r"duplicate id 'ok' \(first used on line 1\)",
        ),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", bad_line])
    with pytest.raises(ValueError, match=message) as e:
        load_suite(path)
    assert f"{path}, line 3:" in str(e.value)


def test_duplicate_spec_bench_ids(tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question_id": 7, "category": "c", "turns": ["a"]},
            {"question_id": "7", "category": "c", "turns": ["b"]},
        ],
    )
    with pytest.raises(ValueError, match=r"line 2: duplicate id '7'"):
        load_suite(path)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=r"nope\.jsonl: not found"):
        load_suite(missing)
    with pytest.raises(ValueError, match="is a directory"):
        load_suite(tmp_path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no prompts in the file"):
        load_suite(path)


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"id": "a", "category": "c", "prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_suite(path)
