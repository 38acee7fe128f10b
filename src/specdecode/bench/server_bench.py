"""`specdecode bench --server [LABEL=]URL`: the suite through OpenAI-compatible servers.

Every server is one setting of the benchmark, so vLLM, SGLang, llama-server and our own server land
in the same records, summary, report and plots as our engine's methods. A server labelled `ar`
(one that does not speculate) is the baseline of the speedups and of the greedy identity checks
(which compare texts: a server gives no token ids).

Order of work: probe every server (its model), warm each up with one unrecorded request (a short
one on a prompt of no suite, data/suites.py's WARM_UP: a server that drafts from earlier answers
learns nothing of the measured prompts from it), then
per repeat, one category at a time, per prompt every server in an order rotated by the prompt's
index, each request alone on its server (streamed, timed as `bench-serve` times it). Acceptance
comes from each server's Prometheus counters (server_counters.py): a scrape after each request
gives that request's drafted and accepted tokens; at a category's end, after `settle_s`, one
more scrape adds counts that arrived late to the category's last request, so a category's sums
are exact whatever the server's timing. A server without counters is measured for speed alone
(its records carry no acceptance; the report says so). A category's records are written together
when it ends: an interrupted run keeps the categories it finished.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdecode.bench.aggregate import summarize
from specdecode.bench.records import Record
from specdecode.bench.report import write_report
from specdecode.bench.runner import load_results
from specdecode.bench.serve_client import OK, Endpoint, Outcome, probe, stream_one
from specdecode.bench.serve_load import CHAT, COMPLETIONS, choose_model, machine_info
from specdecode.bench.server_counters import Counters, scrape
from specdecode.core import metrics
from specdecode.data.suites import WARM_UP, WARM_UP_TOKENS, BenchPrompt, load_suite

RESULTS, SUMMARY, RUN = "results.jsonl", "summary.json", "run.json"
BASELINE = "ar"  # the label of a server that does not speculate
SERVER = "server"  # the method of every other server's records


@dataclass(frozen=True)
class ServerSpec:
    """One `--server [LABEL=]URL`."""

    label: str
    endpoint: Endpoint

    @classmethod
    def parse(cls, text: str, api_key: str | None = None) -> ServerSpec:
        # LABEL=URL: the label ends at the last "=" before the URL's scheme (a label may hold
        # "=", as in `k=2`); no "=" there: the URL alone
        head, scheme_sep, rest = text.partition("://")
        label, sep, scheme = head.rpartition("=")
        url = scheme + scheme_sep + rest if sep else text
        label = label if sep else ""
        endpoint = Endpoint.parse(url, api_key)
        return cls(label.strip() or endpoint.url.split("://", 1)[1], endpoint)


@dataclass
class ServerBenchConfig:
    servers: list[str]  # [LABEL=]URL each
    out: str
    model: str | None = None  # the model to ask every server for (None: the one it lists)
    api_key: str | None = None
    prompts_file: str | None = None
    categories: list[str] | None = None
    limit: int | None = None
    turns: str = "first"
    chat: bool = True
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    timeout_s: float = 600.0
    settle_s: float = 0.5  # before a category's last scrape (servers count asynchronously)
    warmup: bool = True
    command: str | None = None

    def validate(self) -> list[ServerSpec]:
        """The servers, parsed; ValueError naming the bad option."""
        specs = [ServerSpec.parse(s, self.api_key) for s in self.servers]
        if not specs:
            raise ValueError("--server: give at least one [LABEL=]URL")
        labels = [s.label for s in specs]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(f"--server: the label {twice[0]!r} is given twice (LABEL=URL)")
        for name, value, low in (
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--repeats", self.repeats, 1),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low} (got {value})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1 (got {self.limit})")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"--temperature must be in [0, 2] (got {self.temperature})")
        if self.turns == "all" and not self.chat:
            raise ValueError("--turns all needs the chat route (drop --no-chat)")
        return specs


@dataclass
class _Server:
    """A server as the run uses it: where, which model, its last counters."""

    label: str
    endpoint: Endpoint
    model: str
    counters: Counters | None  # None: it exports no speculative counters
    records: list[Record] = field(default_factory=list)  # this category's, in order


def run_server_bench(config: ServerBenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run the suite through every server; write DIR/{results.jsonl,summary.json,report.md}."""
    specs = config.validate()
    prompts = load_suite(config.prompts_file, categories=config.categories, limit=config.limit)
    servers = [_connect(spec, config.model) for spec in specs]
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = _run_info(config, servers)
    (out_dir / RUN).write_text(json.dumps(info, indent=1))
    if config.warmup:
        warm = replace(config, max_new_tokens=min(WARM_UP_TOKENS, config.max_new_tokens))
        for server in servers:
            _request(server, warm, _Conversation(WARM_UP), 0)
        time.sleep(config.settle_s)
        for server in servers:
            _scrape(server)  # a server counting late has counted the warm-up by the next one
    by_category: dict[str, list[BenchPrompt]] = defaultdict(list)
    for prompt in prompts:
        by_category[prompt.category].append(prompt)
    turns = sum(_turns(p, config) for p in prompts)
    bar = tqdm(total=config.repeats * turns * len(servers), desc="bench", disable=not progress)
    records: list[Record] = []
    with open(out_dir / RESULTS, "w") as results:
        for repeat in range(config.repeats):
            for group in by_category.values():
                for server in servers:
                    server.counters = _scrape(server)  # whatever happened between categories
                    server.records = []
                for index, prompt in enumerate(group):
                    order = servers[index % len(servers) :] + servers[: index % len(servers)]
                    for server in order:
                        talk = _Conversation(prompt)
                        for turn in range(_turns(prompt, config)):
                            server.records.append(_run_one(server, config, talk, turn, repeat))
                            bar.update()
                time.sleep(config.settle_s)
                done = _close_category(servers)
                for record in done:
                    results.write(json.dumps(record.to_dict()) + "\n")
                results.flush()
                records += done
    bar.close()
    summary = summarize(records)
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    write_report(out_dir, summary, records, info)
    return summary


def merge_runs(folders: list[Path], out: Path, **info: Any) -> dict[str, Any]:
    """Runs of one server each beside an `ar` server (one run after another) as one run in
    `out`: each folder's records pair with its own `ar` records (their repeats numbered apart,
    folder after folder), for the speedups and the identity of texts; the `ar` rows pool every
    folder's. Writes run.json (every server once; `info` added), summary, report and plots.
    Returns the summary."""
    records: list[Record] = []
    for folder in folders:
        offset = max((r.repeat for r in records), default=-1) + 1
        records += [replace(r, repeat=r.repeat + offset) for r in load_results(folder)]
    if not records:
        raise ValueError("no server run to put together")
    mark_text_identity(records)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RESULTS, "w") as results:
        results.writelines(json.dumps(r.to_dict()) + "\n" for r in records)
    infos = [json.loads((folder / RUN).read_text()) for folder in folders]
    merged = dict(infos[0]) | info
    servers: dict[str, Any] = {}  # a baseline measured beside every folder's: listed once
    for server in (s for i in infos for s in i["servers"]):
        servers.setdefault(server["label"], server)
    merged["servers"] = list(servers.values())
    merged["settings"] = [s["label"] for s in merged["servers"]]
    (out / RUN).write_text(json.dumps(merged, indent=1))
    summary = summarize(records)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    write_report(out, summary, records, merged)
    return summary


def _turns(prompt: BenchPrompt, config: ServerBenchConfig) -> int:
    return len(prompt.turns) if config.turns == "all" else 1


def _connect(spec: ServerSpec, wanted: str | None) -> _Server:
    model = choose_model(probe(spec.endpoint), wanted, spec.endpoint.url)
    server = _Server(spec.label, spec.endpoint, model, None)
    server.counters = _scrape(server)
    return server


def _scrape(server: _Server) -> Counters | None:
    return scrape(server.endpoint, server.model)


class _Conversation:
    """One server's view of a prompt: its turns with that server's answers in between."""

    def __init__(self, prompt: BenchPrompt) -> None:
        self.prompt = prompt
        self.messages: list[dict[str, str]] = []

    def body(self, turn: int, config: ServerBenchConfig, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": config.max_new_tokens,
            "temperature": config.temperature,
            "seed": config.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if config.chat:
            self.messages.append({"role": "user", "content": self.prompt.turns[turn]})
            body["messages"] = list(self.messages)
        else:
            body["prompt"] = self.prompt.turns[turn]
        return body

    def answer(self, text: str) -> None:
        if self.messages:
            self.messages.append({"role": "assistant", "content": text})


def _request(server: _Server, config: ServerBenchConfig, talk: _Conversation, turn: int) -> Outcome:
    body = talk.body(turn, config, server.model)
    route = CHAT if config.chat else COMPLETIONS
    outcome = stream_one(server.endpoint, route, body, chat=config.chat, timeout_s=config.timeout_s)
    if outcome.kind != OK:
        raise ValueError(f"{server.label} ({server.endpoint.url}) failed: {outcome.error}")
    talk.answer(outcome.text)
    return outcome


def _run_one(
    server: _Server, config: ServerBenchConfig, talk: _Conversation, turn: int, repeat: int
) -> Record:
    outcome = _request(server, config, talk, turn)
    record = _record(server, config, talk.prompt, turn, repeat, outcome)
    if server.counters is not None:
        now = _scrape(server)
        if now is not None:
            _add_counts(record, now.minus(server.counters))
            server.counters = now
    return record


def _close_category(servers: list[_Server]) -> list[Record]:
    """The category's records of every server, late counts added and greedy identity marked."""
    done: list[Record] = []
    for server in servers:
        if server.counters is not None and server.records:
            now = _scrape(server)
            late = now.minus(server.counters) if now is not None else None
            if late is not None and (late.draft_tokens or late.accepted):
                last = server.records[-1]
                _add_counts(last, _counts_of(last).plus(late))
        done += server.records
    mark_text_identity(done)
    return done


def mark_text_identity(records: list[Record]) -> None:
    """Each greedy record's identity to the `ar` server's text for the same prompt, turn and
    repeat (also for records of separate runs put together, one server after another)."""
    baseline = {(r.prompt_id, r.turn, r.repeat): r for r in records if r.setting == BASELINE}
    for record in records:
        ar = baseline.get((record.prompt_id, record.turn, record.repeat))
        if ar is not None and record is not ar and record.temperature == 0:
            _mark_identity(ar, record)


def _record(
    server: _Server,
    config: ServerBenchConfig,
    prompt: BenchPrompt,
    turn: int,
    repeat: int,
    outcome: Outcome,
) -> Record:
    n = outcome.completion_tokens or 0
    ttft = outcome.ttft_s or outcome.latency_s
    decode_s = outcome.latency_s - ttft
    return Record(
        prompt_id=prompt.id,
        category=prompt.category,
        turn=turn,
        repeat=repeat,
        method="ar" if server.label == BASELINE else SERVER,
        setting=server.label,
        k_policy=SERVER,
        dtype="server",
        temperature=config.temperature,
        prompt_tokens=outcome.prompt_tokens or 0,
        new_tokens=n,
        wall_time_s=outcome.latency_s,
        ttft_s=ttft,
        decode_s=decode_s,
        first_chunk=1,  # a first chunk may hold more tokens: then the decode rate is a floor
        tokens_per_s=metrics.ratio(n, outcome.latency_s),
        decode_tokens_per_s=metrics.ratio(n - 1, decode_s) if n > 1 else None,
        memory_source="server (not measured)",
        extra={
            "server": server.endpoint.url,
            "model": server.model,
            "text": outcome.text,
            "finish_reason": outcome.finish_reason,
            "token_source": outcome.token_source,
        },
    )


def _counts_of(record: Record) -> Counters:
    return Counters(
        record.steps or 0,
        record.drafted or 0,
        record.accepted or 0,
        tuple(record.accepted_at or ()),
        tuple(record.drafted_at) if record.drafted_at is not None else None,
    )


def _add_counts(record: Record, counts: Counters) -> None:
    """`counts` (a request's counter differences) as the record's speculative counters."""
    drafts, drafted, accepted = int(counts.drafts), int(counts.draft_tokens), int(counts.accepted)
    record.steps, record.drafted, record.accepted = drafts, drafted, accepted
    record.emitted = drafts + accepted  # vLLM's τ: 1 + accepted per drafting step
    record.acceptance_rate = metrics.acceptance_rate(accepted, drafted)
    record.mean_acceptance_length = metrics.mean_acceptance_length(drafts + accepted, drafts)
    record.accepted_at = [int(a) for a in counts.accepted_at]
    drafted_at = counts.drafted_at
    width = len(counts.accepted_at)
    if drafted_at is None and width and drafted == drafts * width:
        drafted_at = (counts.drafts,) * width  # a fixed k: every step drafted every position
    record.drafted_at = [int(d) for d in drafted_at] if drafted_at is not None else None
    if record.drafted_at is not None:
        record.per_position_acceptance = metrics.per_position_acceptance(
            record.accepted_at, record.drafted_at
        )
    record.k = round(drafted / drafts) if drafts else 0


def _mark_identity(ar: Record, record: Record) -> None:
    """Greedy identity by text (a server gives no token ids): the first differing character."""
    ours, theirs = record.extra.get("text") or "", ar.extra.get("text") or ""
    record.identical_to_ar = ours == theirs
    record.first_divergence = None
    if ours != theirs:
        at = next(
            (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        record.first_divergence = {
            "position": f"char {at}",
            "ar_token": repr(theirs[at : at + 12]),
            "spec_token": repr(ours[at : at + 12]),
            "top2_margin": None,
        }


def _run_info(config: ServerBenchConfig, servers: list[_Server]) -> dict[str, Any]:
    return {
        "command": config.command,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": asdict(config) | {"api_key": None},
        "settings": [s.label for s in servers],
        "servers": [
            {
                "label": s.label,
                "url": s.endpoint.url,
                "model": s.model,
                "counters": s.counters is not None,
            }
            for s in servers
        ],
        "client_machine": machine_info(),
    }
