"""`specdecode bench-serve`: closed-loop streaming load on an OpenAI-compatible endpoint.

For each concurrency level C, C client threads each send streamed requests back to back (the
next as soon as the last one ended; after a 429, after its Retry-After, at most
`MAX_RETRY_WAIT_S`) until the level's requests are sent (`requests_per_level`, default
max(16, 4·C)) or its `duration_s` has passed (requests under way then still finish). Request i
of a level (in order of sending) takes prompt i mod n of the prompts in a fixed order (the suite
interleaved by category), its first turn, raw (`/v1/completions`) or as one user message
(`--chat`, `/v1/chat/completions`); with `prompt_order="continue"`, prompt (s + i) mod n, s the
requests sent before it (the warm-up's included), so that a prompt comes back only after all n
were sent: a server that keeps earlier prompts (a prefix cache) meets each level's prompts as
new where "restart" (the default) meets the same first prompts at every level. One `warmup`
request runs first, unrecorded.

Writes to `out`: results.jsonl (one record per request, a level at a time), summary.json (per
level and category: serve_stats.py; the endpoint, model and settings), report.md and plots
(serve_report.py).
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdecode.bench.serve_client import OK, Endpoint, Outcome, probe, stream_one
from specdecode.bench.serve_report import write_report
from specdecode.bench.serve_stats import per_request, summarize_levels, token_sources
from specdecode.data.suites import BenchPrompt, interleave_by_category, load_suite

RESULTS, SUMMARY = "results.jsonl", "summary.json"
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
MAX_CONCURRENCY = 1024
MAX_RETRY_WAIT_S = 10.0
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT_ORDERS = ("restart", "continue")


def default_requests(concurrency: int) -> int:
    """A level's requests when neither a count nor a duration is given."""
    return max(16, 4 * concurrency)


@dataclass
class LoadConfig:
    """One `bench-serve` run; `validate` checks everything that needs no network."""

    endpoint: str
    out: str
    concurrency: list[int]
    prompts_file: str | None = None
    categories: list[str] | None = None
    max_new_tokens: int = 64
    requests_per_level: int | None = None
    duration_s: float | None = None
    model: str | None = None
    chat: bool = False
    temperature: float = 0.0
    seed: int | None = None
    label: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    warmup: int = 1
    stream_usage: bool = True  # send stream_options.include_usage
    command: str | None = None
    prompt_order: str = "restart"  # each level from the first prompt, or "continue"

    def validate(self) -> list[BenchPrompt]:
        """The prompts, in sending order; ValueError naming what is allowed for a bad option."""
        levels = self.concurrency
        if not levels:
            raise ValueError("--concurrency: give at least one level, e.g. 1,2,4,8,16")
        bad = [c for c in levels if not 1 <= c <= MAX_CONCURRENCY]
        if bad:
            raise ValueError(
                f"--concurrency: each level is a number of clients from 1 to {MAX_CONCURRENCY} "
                f"(got {', '.join(map(str, bad))})"
            )
        if len(set(levels)) != len(levels):
            raise ValueError(f"--concurrency: a level appears twice ({levels})")
        if self.requests_per_level is not None and self.duration_s is not None:
            raise ValueError("give --requests-per-level or --duration, not both")
        if self.requests_per_level is not None:
            if self.requests_per_level < 1:
                raise ValueError(
                    f"--requests-per-level must be >= 1 (got {self.requests_per_level})"
                )
            short = [c for c in levels if c > self.requests_per_level]
            if short:
                raise ValueError(
                    f"--requests-per-level {self.requests_per_level} is below the concurrency "
                    f"{short[0]}: some clients would send nothing (give at least {max(levels)})"
                )
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds (got {self.duration_s})")
        for name, value, low in (
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--warmup", self.warmup, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low} (got {value})")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"--temperature must be in [0, 2] (got {self.temperature})")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds (got {self.timeout_s})")
        if self.prompt_order not in PROMPT_ORDERS:
            raise ValueError(
                f"--prompt-order must be one of {', '.join(PROMPT_ORDERS)} (got {self.prompt_order!r})"
            )
        Endpoint.parse(self.endpoint)
        return interleave_by_category(load_suite(self.prompts_file, self.categories))

    @property
    def route(self) -> str:
        return CHAT if self.chat else COMPLETIONS

    def body(self, model: str, prompt: BenchPrompt) -> dict[str, Any]:
        """One request's JSON body (a multi-turn prompt sends its first turn)."""
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "stream": True,
        }
        if self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt.turns[0]}]
        else:
            body["prompt"] = prompt.turns[0]
        return body


def choose_model(listed: list[str], wanted: str | None, url: str) -> str:
    """--model, checked against what the endpoint lists; else the one model it lists."""
    if wanted is not None:
        if listed and wanted not in listed:
            raise ValueError(
                f"{url} does not serve model {wanted!r} (it lists: {', '.join(listed)})"
            )
        return wanted
    if len(listed) != 1:
        what = f"several models ({', '.join(listed)})" if listed else "no model"
        raise ValueError(f"{url} lists {what}: name one with --model")
    return listed[0]


def run_load(config: LoadConfig, progress: bool = True) -> dict[str, Any]:
    """Measure every level (see the module docstring); returns the summary it wrote."""
    prompts = config.validate()
    endpoint = Endpoint.parse(config.endpoint, config.api_key)
    model = choose_model(probe(endpoint), config.model, endpoint.url)

    def send(prompt: BenchPrompt) -> Outcome:
        return stream_one(
            endpoint,
            config.route,
            config.body(model, prompt),
            chat=config.chat,
            timeout_s=config.timeout_s,
        )

    for i in range(config.warmup):
        outcome = send(prompts[i % len(prompts)])
        if outcome.kind != OK:
            raise ValueError(
                f"the warm-up request to {endpoint.url}{config.route} failed ({outcome.error}); "
                "nothing was measured"
            )
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    records: list[dict[str, Any]] = []
    (out / RESULTS).write_text("")
    first = config.warmup if config.prompt_order == "continue" else 0
    for concurrency in config.concurrency:
        level = run_level(send, prompts, concurrency, config, progress, first)
        if config.prompt_order == "continue":
            first += len(level)
        with (out / RESULTS).open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in level)
        records += level
    summary = build_summary(records, config, endpoint, model, started)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))

    write_report(out, summary)
    return summary


def run_level(
    send: Callable[[BenchPrompt], Outcome],
    prompts: list[BenchPrompt],
    concurrency: int,
    config: LoadConfig,
    progress: bool = True,
    first: int = 0,
) -> list[dict[str, Any]]:
    """One level's records (in order of sending): `concurrency` closed-loop clients, request i
    taking prompt (first + i) mod n."""
    count = config.requests_per_level
    if count is None and config.duration_s is None:
        count = default_requests(concurrency)
    lock = threading.Lock()
    sent = 0
    records: list[dict[str, Any]] = []
    failures: list[BaseException] = []
    bar = tqdm(total=count, desc=f"concurrency {concurrency}", unit="req", disable=not progress)
    start = time.perf_counter()

    def client(number: int) -> None:
        nonlocal sent
        try:
            while True:
                with lock:
                    now = time.perf_counter() - start
                    over = sent >= count if count is not None else now >= config.duration_s
                    if over or failures:
                        return
                    index, sent = sent, sent + 1
                prompt = prompts[(first + index) % len(prompts)]
                began = time.perf_counter() - start
                outcome = send(prompt)
                ended = time.perf_counter() - start
                record = make_record(outcome, concurrency, index, number, prompt, began, ended)
                with lock:
                    records.append(record)
                    bar.update()
                if outcome.kind == "rate_limited":
                    time.sleep(
                        min(
                            MAX_RETRY_WAIT_S,
                            1.0 if outcome.retry_after_s is None else outcome.retry_after_s,
                        )
                    )
        except BaseException as err:  # a bug, not a failed request: stop the level, re-raise
            with lock:
                failures.append(err)

    threads = [
        threading.Thread(target=client, args=(n,), daemon=True, name=f"bench-serve-{n}")
        for n in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bar.close()
    if failures:
        raise failures[0]
    return sorted(records, key=lambda r: r["index"])


def make_record(
    outcome: Outcome,
    concurrency: int,
    index: int,
    client: int,
    prompt: BenchPrompt,
    start_s: float,
    end_s: float,
) -> dict[str, Any]:
    """A results.jsonl line: the request, its outcome, its tokens/s and TPOT."""
    record = {
        "concurrency": concurrency,
        "index": index,
        "client": client,
        "category": prompt.category,
        "prompt_id": prompt.id,
        "start_s": _round(start_s),
        "end_s": _round(end_s),
        **asdict(outcome),
    }
    record.pop("retry_after_s")
    record.pop("text")  # a load run keeps times and counts, not answers
    for key in ("ttft_s", "latency_s"):
        record[key] = _round(record[key])
    record["itl_s"] = [_round(gap) for gap in record["itl_s"]]
    record.update({k: _round(v) for k, v in per_request(record).items()})
    return record


def build_summary(
    records: list[dict[str, Any]],
    config: LoadConfig,
    endpoint: Endpoint,
    model: str,
    started: str,
) -> dict[str, Any]:
    settings = asdict(config)
    for key in ("endpoint", "out", "label", "api_key", "command", "model"):
        settings.pop(key)
    return {
        "label": config.label or Path(config.out).name,
        "endpoint": endpoint.url,
        "route": config.route,
        "model": model,
        "started": started,
        "command": config.command,
        "settings": settings,
        "token_counting": token_sources(records),
        "client_machine": machine_info(),
        "levels": summarize_levels(records),
    }


def machine_info() -> dict[str, Any]:
    """The client machine (the server may run elsewhere)."""
    # slow import (~3 s): auto.calibrate brings torch and the engine, which this HTTP client
    # needs for nothing else (the server it measures may run elsewhere)
    from specdecode.auto.calibrate import cpu_identity

    return {
        "cpu": cpu_identity()["model name"],
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
