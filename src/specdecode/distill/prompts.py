"""The prompts a distillation answers: a suite (the bench suite or a user's JSONL) split by id into
prompts trained on and prompts held out, and prompts the target writes itself like those.

The split (`split_heldout`) is per category and depends on the ids alone: a category's prompts are
ordered by the SHA-256 of their id and the first round(share x n) are held out (at least one, at
most n - 1, for a category of two or more; a category of one prompt is trained on). The held-out
prompts are never answered here, so never trained on: `benchmarks/distill_gain.py` measures on
them. For the built-in suite at the default share 0.25 that is 2 of the 8 prompts per category
(`tests/test_distill.py` pins the list; docs/results.md shows it).

Self-written prompts (`--self-prompts N`): for each category, N prompts the target writes when
shown up to three of the category's training prompts (first turns, in turn; each cut at
MAX_EXAMPLE_CHARS; fewer where a short context leaves no room, `fitting_instruction`) and asked
for one new request of the same kind, about a seed topic where the category is a built-in one
(eight per category, in turn). So they follow the prompts given (the
built-in suite's or a user's `--prompts FILE`), never a held-out one: a cached prompt written from
an example that is now held out, or written another way (PROMPT_FORM), is written again. Sampled
at temperature 1.0, top-p 0.95, one seed per attempt, as long as an answer may be
(`--max-new-tokens`); empty ones, duplicates and copies of an example are dropped and up to 2N
attempts made. They are trained on (with the suite's training prompts); the held-out prompts stay
the suite's. Cached in DIR/data/self_prompts.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdecode.core.request import GenerationRequest
from specdecode.data.suites import BenchPrompt, load_suite
from specdecode.models.files import write_atomic
from specdecode.runtime.session import DEFAULT_MAX_LEN, JobError, generate_each

# category -> (what to ask for, seed topics)
# fmt: off
SEED_TOPICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "code_generation": (
        "a request to a coding assistant for a short function or script",
        (
            "parsing dates", "a small command-line tool", "reading a CSV file", "a retry helper",
            "a web request", "sorting records", "a unit test", "a text search",
        ),
    ),
    "code_editing": (
        "a request to improve a short piece of code, with the code included",
        (
            "a slow loop", "missing error handling", "unclear variable names", "duplicated code",
            "a long function", "global state", "a missing type check", "an off-by-one bug",
        ),
    ),
    "chat": (
        "a question someone might ask a friendly assistant in a conversation",
        (
            "cooking at home", "planning a trip", "learning a language", "keeping fit",
            "choosing a book", "a new job", "gardening", "saving money",
        ),
    ),
    "creative_writing": (
        "a request for a short poem, story or dialogue",
        (
            "the sea at night", "a robot learning to paint", "an old bookshop", "the first snow",
            "a lost letter", "a city in the rain", "two rival chefs", "a lighthouse keeper",
        ),
    ),
    "summarization": (
        "a request to summarize a short passage, with the passage of a few sentences included",
        (
            "a company announcement", "a science news item", "a meeting's notes", "a book review",
            "a product recall", "a sports report", "a school newsletter", "a travel blog post",
        ),
    ),
    "translation": (
        "a request to translate two or three sentences, with the sentences included",
        (
            "English to French", "German to English", "English to Spanish", "Italian to English",
            "French to English", "English to German", "Spanish to English", "English to Italian",
        ),
    ),
    "question_answering": (
        "a factual question with a short answer",
        (
            "history", "geography", "biology", "everyday physics",
            "chemistry", "astronomy", "music", "the human body",
        ),
    ),
    "math_reasoning": (
        "a short word problem in arithmetic or algebra",
        (
            "shopping and prices", "travel times", "sharing things fairly", "percentages",
            "ages", "areas and lengths", "work rates", "interest on savings",
        ),
    ),
    "extraction_rag": (
        "a request to pull facts out of a short text, with the text included",
        (
            "an invoice", "a job advert", "a product page", "an event announcement",
            "a hotel booking", "a medical leaflet", "a rental listing", "a flight itinerary",
        ),
    ),
}
# fmt: on
SELF_PROMPTS_FILE = "self_prompts.jsonl"
SELF_TEMPERATURE, SELF_TOP_P = 1.0, 0.95
PROMPT_FORM = "examples"  # how a row was asked for; a cached row of another form is not reused
EXAMPLES_SHOWN = 3  # training prompts shown per request for a new one
MAX_EXAMPLE_CHARS = 1500  # an example longer than this is cut (a user's prompt may hold a document)


@dataclass(frozen=True)
class DistillPrompt:
    """A prompt answered for training (its first user turn) or held out."""

    id: str
    category: str
    text: str

    @property
    def digest(self) -> str:
        """A short hash of the text: an answer cached for an id whose text changed is redone."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:12]


def _rank(prompt_id: str) -> str:
    return hashlib.sha256(prompt_id.encode()).hexdigest()


def held_out_count(n: int, share: float) -> int:
    """How many of a category's n prompts are held out."""
    if share <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, int(share * n + 0.5)))


def split_heldout(
    prompts: Sequence[BenchPrompt], share: float
) -> tuple[list[BenchPrompt], list[BenchPrompt]]:
    """(trained on, held out), each in the suite's order; see the module's docstring."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    held: set[str] = set()
    for members in by_category.values():
        ranked = sorted(members, key=lambda p: _rank(p.id))
        held.update(p.id for p in ranked[: held_out_count(len(members), share)])
    return [p for p in prompts if p.id not in held], [p for p in prompts if p.id in held]


def suite_prompts(
    path: str | None, categories: Sequence[str] | None, share: float
) -> tuple[list[DistillPrompt], list[BenchPrompt]]:
    """The suite's training prompts (first turns) and its held-out prompts; ValueError for an
    empty or bad suite and when nothing is left to train on."""
    try:
        prompts = load_suite(path, categories=categories)
    except ValueError as err:
        raise ValueError(f"no prompts to distil on: {err}") from None
    train, held = split_heldout(prompts, share)
    if not train:
        raise ValueError(
            f"no prompts to distil on: all {len(prompts)} prompts are held out (--holdout {share})"
        )
    return [DistillPrompt(p.id, p.category, p.turns[0]) for p in train], held


def _cached_self_prompts(data_dir: Path, train_ids: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The cached rows by category that may be reused: written the current way, from examples
    that are all still training prompts (never from one now held out)."""
    path = data_dir / SELF_PROMPTS_FILE
    kept: dict[str, list[dict[str, Any]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("form") == PROMPT_FORM and set(row.get("examples", ())) <= train_ids:
                    kept.setdefault(row["category"], []).append(row)
    return kept


def _chosen(kept: dict[str, list[dict[str, Any]]], categories: Sequence[str], n: int):
    rows = [r for c in categories for r in kept.get(c, [])[:n]]
    return [DistillPrompt(r["id"], r["category"], r["prompt"]) for r in rows]


def _categories(train_prompts: Sequence[DistillPrompt]) -> list[str]:
    return list(dict.fromkeys(p.category for p in train_prompts))


def cached_self_prompts(
    data_dir: Path, train_prompts: Sequence[DistillPrompt], per_category: int
) -> list[DistillPrompt] | None:
    """The self-written prompts when every category already has what was asked (else None: the
    target must write some)."""
    kept = _cached_self_prompts(data_dir, {p.id for p in train_prompts})
    categories = _categories(train_prompts)
    if any(len(kept.get(c, [])) < per_category for c in categories):
        return None
    return _chosen(kept, categories, per_category)


def _cut(text: str) -> str:
    if len(text) <= MAX_EXAMPLE_CHARS:
        return text
    return text[:MAX_EXAMPLE_CHARS].rsplit(None, 1)[0] + " ..."


def examples_for(pool: Sequence[DistillPrompt], attempt: int) -> list[DistillPrompt]:
    """The training prompts shown for one attempt: up to EXAMPLES_SHOWN, starting `attempt` places
    along, so that every prompt of the category is shown in turn."""
    shown = min(EXAMPLES_SHOWN, len(pool))
    return [pool[(attempt + j) % len(pool)] for j in range(shown)]


def instruction(category: str, examples: Sequence[DistillPrompt], attempt: int) -> str:
    """What the target is asked, to write one new prompt like `examples`."""
    shown = "\n\n".join(f"Request {i + 1}:\n{_cut(p.text)}" for i, p in enumerate(examples))
    kind = ""  # a built-in category: what its requests are, and a topic in turn
    if category in SEED_TOPICS:
        what, topics = SEED_TOPICS[category]
        kind = f" ({what}), about {topics[attempt % len(topics)]}"
    return (
        f"Requests users sent to an assistant:\n\n{shown}\n\nWrite one new request of the "
        f"same kind{kind}. Reply with the request alone."
    )


_LABEL = re.compile(r"^\s*request\s*\d*\s*:", re.IGNORECASE)


def _clean(text: str) -> str:
    """The written request without surrounding white space, quotes or a "Request 4:" label
    (copied from the instruction's)."""
    text = _LABEL.sub("", text, count=1).strip()
    for left, right in (('"', '"'), ("\u201c", "\u201d")):
        if len(text) > 1 and text.startswith(left) and text.endswith(right):
            text = text[1:-1].strip()
    return text


def fitting_instruction(
    encode: Callable[[str], list[int]],
    category: str,
    pool: Sequence[DistillPrompt],
    attempt: int,
    room: int,
) -> tuple[list[int], list[DistillPrompt]]:
    """The ids of one attempt's instruction (`encode`: text -> ids) and the examples it shows:
    fewer than EXAMPLES_SHOWN where they would leave less than `room` tokens for the answer."""
    shown = examples_for(pool, attempt)
    while True:
        ids = encode(instruction(category, shown, attempt))
        if len(ids) <= room or len(shown) == 1:  # one example too many is refused when run
            return ids, shown
        shown = shown[:-1]


def _room(engine: Any, max_new_tokens: int) -> int:
    """How many tokens an instruction may take: the smallest context (the target's, a model
    draft's, a batch row's) less the answer's length."""
    return min(DEFAULT_MAX_LEN, engine.context_limit() or DEFAULT_MAX_LEN) - max_new_tokens


def self_prompts(
    engine: Any,
    train_prompts: Sequence[DistillPrompt],
    per_category: int,
    data_dir: Path,
    chat: bool,
    max_new_tokens: int,
    progress: bool = True,
    batch_rows: int = 1,
) -> tuple[list[DistillPrompt], dict[str, Any]]:
    """`per_category` prompts for each category of `train_prompts`, written by the target
    (`engine`, a SpeculativeDecoder, `batch_rows` at a time: `session.generate_each`; each at most
    `max_new_tokens` long, the answers' length) from the category's training prompts as
    examples; cached in data_dir/self_prompts.jsonl (a category already there is not asked
    again); and what it took this run (attempts, dropped)."""

    def request(seed: int) -> GenerationRequest:
        params = engine.sampling_params(SELF_TEMPERATURE, top_p=SELF_TOP_P)
        return GenerationRequest(max_new_tokens, params, seed=seed)

    def encode(text: str) -> list[int]:
        return engine.encode_prompt(text, chat=chat)

    categories = _categories(train_prompts)
    room = _room(engine, max_new_tokens)
    path = data_dir / SELF_PROMPTS_FILE
    kept = _cached_self_prompts(data_dir, {p.id for p in train_prompts})
    report = {"per_category": per_category, "attempts": 0, "dropped": 0}
    missing = sum(max(0, per_category - len(kept.get(c, []))) for c in categories)
    bar = tqdm(total=missing, desc="prompts", unit="prompt", disable=not progress or not missing)
    for category in categories:
        rows = kept.setdefault(category, [])
        if len(rows) >= per_category:
            continue
        pool = [p for p in train_prompts if p.category == category]
        seen = {r["prompt"] for r in rows} | {p.text.strip() for p in pool}
        attempt = len(rows)
        # in waves of as many attempts as prompts are missing, `batch_rows` at a time, each
        # kept in the order of its attempt (its seed), as when they are written one at a time
        while len(rows) < per_category and attempt < 2 * per_category:
            wave = range(attempt, min(2 * per_category, attempt + per_category - len(rows)))
            attempt = wave.stop
            made = {a: fitting_instruction(encode, category, pool, a, room) for a in wave}
            jobs = [(made[a][0], request(a)) for a in wave]
            try:
                texts = dict(generate_each(engine, jobs, batch_rows))
            except JobError as err:  # even one example leaves no room for the answer
                example = made[wave[err.index]][1][0].id
                raise ValueError(
                    f"--self-prompts, writing from prompt {example!r}: {err}"
                ) from None
            for index, seed in enumerate(wave):
                report["attempts"] += 1
                text = _clean(texts[index].text or "")
                if not text or text in seen:
                    report["dropped"] += 1
                    continue
                seen.add(text)
                bar.update()
                rows.append(
                    {
                        "id": f"self-{category}-{len(rows) + 1:03d}",
                        "category": category,
                        "prompt": text,
                        "form": PROMPT_FORM,
                        "examples": [p.id for p in made[seed][1]],
                        "seed": seed,
                    }
                )
        body = "".join(json.dumps(r) + "\n" for c in kept for r in kept[c])
        write_atomic(path, "the self-written prompts", lambda p, body=body: p.write_text(body))
    bar.close()
    chosen = _chosen(kept, categories, per_category)
    report["written"] = len(chosen)
    return chosen, report
