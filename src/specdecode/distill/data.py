"""The training data: the target's own answers to the training prompts and, at every answer
position, the target's next-token distribution, cached in DIR/data as it is made.

Each prompt is answered greedily (temperature 0) and `samples` times at each temperature above 0,
`rows` answers at a time by batched decoding of the target alone (`generate_each`: a
`BatchSession`, each answer with its own seed), or with `rows` = 1 one at a time by speculative
decoding with the untrained draft (lossless either way: the answers are the target's own). The
distributions come from the very forwards that decode the answer (`Batch.add(on_logits=...)`):
no second forward over prompt + answer. Per position it keeps the
`top_k` most probable tokens' log-probabilities (float16; the logits minus their log-sum-exp, so
they need no normaliser), their ids (int32) and the probability mass of all other tokens (float32,
the tail bucket), all at temperature 1: a draft that matches the raw distribution matches it at
any temperature. That is about 6 x top_k bytes per position.

Answers are written in shards of `SHARD_ANSWERS` (DIR/data/shard-NNNNN.pt, each written whole or
not at all; manifest.json says which answers each holds, written after its shard). An interrupted
run keeps every shard written and the answers since the last one (the interrupt flushes them); the
next run answers only what is missing. DIR/data/config.json holds what makes the cache reusable
(the target, top_k, the answer length, chat formatting): a run with other values is refused.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdecode.core.request import GenerationRequest
from specdecode.distill.prompts import DistillPrompt
from specdecode.models.files import load_json, load_tensors, save_json, save_tensors
from specdecode.runtime.session import JobError, generate_each

SHARD_ANSWERS = 16
CONFIG, MANIFEST = "config.json", "manifest.json"


@dataclass
class Answer:
    """One answer of the target with its distributions; T = answer tokens, K = top_k."""

    key: str
    prompt_id: str
    category: str
    temperature: float
    prompt_ids: torch.Tensor  # [P] int32
    answer_ids: torch.Tensor  # [T] int32
    top_logprobs: torch.Tensor  # [T, K] float16: log p_target of the K most probable tokens
    top_ids: torch.Tensor  # [T, K] int32
    tail: torch.Tensor  # [T] float32: p_target's mass outside the top K

    @property
    def tokens(self) -> int:
        return int(self.answer_ids.numel())

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Planned:
    """One answer to make: a prompt at a temperature, the sample-th time."""

    prompt: DistillPrompt
    temperature: float
    sample: int

    @property
    def key(self) -> str:
        p = self.prompt
        return f"{p.id}|{p.digest}|t={self.temperature:g}|s={self.sample}"

    @property
    def seed(self) -> int:
        return int(hashlib.sha256(self.key.encode()).hexdigest()[:8], 16)


def plan_answers(
    prompts: Sequence[DistillPrompt], temperatures: Sequence[float], samples: int
) -> list[Planned]:
    """Every answer the prompts need: one greedy, `samples` per temperature above 0."""
    return [
        Planned(p, t, s)
        for p in prompts
        for t in temperatures
        for s in range(1 if t == 0 else samples)
    ]


class AnswerStore:
    """The shards in DIR/data: which answers exist, adding new ones, reading them back; and the
    vocabulary they were made over (`models`: the shared vocabulary size and the target
    tokenizer's digest, recorded once the models are loaded)."""

    def __init__(self, data_dir: Path, data_key: dict[str, Any]) -> None:
        self.dir = data_dir
        self.config_path = data_dir / CONFIG
        self.config: dict[str, Any] = {"settings": data_key}
        if self.config_path.exists():
            self.config = load_json(self.config_path)
            held = self.config["settings"]
            if held != data_key:
                differ = sorted(k for k in {*held, *data_key} if held.get(k) != data_key.get(k))
                raise ValueError(
                    f"{data_dir} holds answers made with other settings ("
                    + ", ".join(
                        f"{k}: {held.get(k)!r} there, {data_key.get(k)!r} now" for k in differ
                    )
                    + f"): use another --out, or remove {data_dir} to make them again"
                )
        else:
            save_json(self.config_path, self.config, "the data settings")
        manifest = data_dir / MANIFEST
        self.shards: dict[str, list[str]] = (
            load_json(manifest)["shards"] if manifest.exists() else {}
        )
        self.buffer: list[Answer] = []

    @property
    def models(self) -> dict[str, Any] | None:
        """{"vocab": shared vocabulary size, "tokenizer": the target tokenizer's digest}, once
        recorded."""
        return self.config.get("models")

    def set_models(self, models: dict[str, Any]) -> None:
        held = self.models
        if held is not None and held != models:
            raise ValueError(
                f"{self.dir} holds answers over another vocabulary ({held} there, {models} "
                f"now): use another --out, or remove {self.dir} to make them again"
            )
        if held is None:
            self.config = {**self.config, "models": models}
            save_json(self.config_path, self.config, "the data settings")

    def done(self) -> set[str]:
        return {key for keys in self.shards.values() for key in keys} | {a.key for a in self.buffer}

    def add(self, answer: Answer) -> None:
        self.buffer.append(answer)
        if len(self.buffer) >= SHARD_ANSWERS:
            self.flush()

    def flush(self) -> None:
        """The buffered answers as a new shard, then the manifest naming it."""
        if not self.buffer:
            return
        name = f"shard-{len(self.shards):05d}.pt"
        save_tensors(self.dir / name, [a.to_dict() for a in self.buffer], f"data shard {name}")
        shards = {**self.shards, name: [a.key for a in self.buffer]}
        save_json(self.dir / MANIFEST, {"shards": shards}, "the data manifest")
        self.shards, self.buffer = shards, []

    def load(self, keys: Sequence[str]) -> list[Answer]:
        """The answers of `keys`, in that order (every one must exist)."""
        wanted = set(keys)
        found: dict[str, Answer] = {a.key: a for a in self.buffer if a.key in wanted}
        for name, held in self.shards.items():
            if wanted.intersection(held):
                for row in load_tensors(self.dir / name):
                    if row["key"] in wanted:
                        found[row["key"]] = Answer(**row)
        missing = [k for k in keys if k not in found]
        if missing:
            raise ValueError(f"{self.dir}: answer {missing[0]!r} is missing from the shards")
        return [found[k] for k in keys]


def top_distributions(
    logits: torch.Tensor, vocab: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top log-probabilities [T, K] float16, their ids [T, K] int32, tail mass [T] float32) of
    the target's raw logits [T, V] over the first `vocab` ids (the vocabulary target and draft
    share), on the CPU."""
    logprobs = logits[:, :vocab].float().log_softmax(-1)  # over the shared ids only
    top = logprobs.topk(min(top_k, vocab), dim=-1)
    tail = (1.0 - top.values.exp().sum(-1)).clamp(min=0.0)  # [T]
    if top_k >= vocab:
        tail.zero_()  # nothing outside: only rounding
    return top.values.half().cpu(), top.indices.int().cpu(), tail.cpu()


def make_answers(
    engine: Any,
    planned: Sequence[Planned],
    store: AnswerStore,
    vocab: int,
    top_k: int,
    max_new_tokens: int,
    chat: bool,
    progress: bool = True,
    rows: int = 1,
) -> int:
    """Answer every planned item the store lacks (the target's answers, through `engine`, a
    SpeculativeDecoder, `rows` at a time: `generate_each`); returns how many were made. An
    interrupt or error flushes what was made first, so the next run continues after it."""
    done = store.done()
    todo = [p for p in planned if p.key not in done]
    jobs = [
        (
            engine.encode_prompt(item.prompt.text, chat=chat),
            GenerationRequest(
                max_new_tokens,
                engine.sampling_params(temperature=item.temperature),
                seed=item.seed,
            ),
        )
        for item in todo
    ]
    bar = tqdm(total=len(todo), desc="answers", unit="answer", disable=not progress or not todo)
    made = tokens = 0
    # each running answer's distributions, kept step by step from the forwards that decode it
    kept: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = defaultdict(list)

    def keep(index: int, logits: torch.Tensor) -> None:  # logits [n, V]: n committed tokens
        kept[index].append(top_distributions(logits, vocab, top_k))

    try:
        for index, result in generate_each(engine, jobs, rows, on_logits=keep):
            item, prompt_ids = todo[index], jobs[index][0]
            answer_ids = list(result.token_ids)
            values, ids, tail = (
                torch.cat(part)[: len(answer_ids)] for part in zip(*kept.pop(index), strict=True)
            )
            store.add(
                Answer(
                    key=item.key,
                    prompt_id=item.prompt.id,
                    category=item.prompt.category,
                    temperature=item.temperature,
                    prompt_ids=torch.tensor(prompt_ids, dtype=torch.int32),
                    answer_ids=torch.tensor(answer_ids, dtype=torch.int32),
                    top_logprobs=values,
                    top_ids=ids,
                    tail=tail,
                )
            )
            made += 1
            tokens += len(answer_ids)
            bar.set_postfix(tokens=tokens, refresh=False)
            bar.update()
    except JobError as err:  # a prompt too long for the context, ...
        raise ValueError(f"prompt {todo[err.index].prompt.id!r}: {err}") from None
    finally:
        bar.close()
        store.flush()
    return made
