"""`run_batch`: a batch file's requests answered by the server's own app, in this process.

Each request goes through the same application `specdecode serve` runs (`create_app`: its
validation, continuous batching, answers and errors), called in process through httpx's ASGI
transport: no socket, and every answer the one the server would give the same body. `max_batch`
requests are in flight, one per row of the batch, taken in batch_order.py's order (each row that
ends is handed the waiting request that shares the longest prompt prefix with it); the files are
batch_file.py's. An interruption (Ctrl-C, SIGTERM) stops the requests in flight, whose answers
are not written, and leaves the output ready to go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from specdecode.core.policies import CostK
from specdecode.runtime.engine import SpeculativeDecoder
from specdecode.server.app import create_app
from specdecode.server.batch_file import (
    BatchRequest,
    ResumableOutput,
    answer_line,
    error_line,
    read_requests,
)
from specdecode.server.batch_order import Key, PrefixOrder, prompt_key
from specdecode.server.limits import DEFAULT_PREFIX_CACHE_MB, PREFILL_CHUNK

# a 503 is the server stopping (our interruption): that request is answered by the next run
RETRY_STATUS = 503


@dataclass
class BatchSummary:
    """What a run did (`requests`: in the input; `earlier`: answered by earlier runs)."""

    output: Path
    requests: int
    earlier: int
    answered: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decoded: int = 0  # completion tokens after each answer's first (the prefill's)
    accepted: int = 0
    drafted: int = 0
    seconds: float = 0.0
    speedup: float | None = None  # decoding's over the target alone's (`estimated_speedup`)
    interrupted: bool = False
    complete: bool = False
    failures: list[tuple[str, str]] = field(default_factory=list)  # (custom_id, why): the file's

    @property
    def tokens_per_s(self) -> float | None:
        return self.completion_tokens / self.seconds if self.seconds > 0 else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def count(self, record: dict[str, Any]) -> None:
        """Add one line answered in this run."""
        self.answered += 1
        body = (record.get("response") or {}).get("body") or {}
        usage = body.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.decoded += max(0, usage.get("completion_tokens", 0) - 1)
        speculative = usage.get("speculative") or {}
        self.accepted += speculative.get("accepted") or 0
        self.drafted += speculative.get("drafted") or 0

    def report(self) -> list[str]:
        """The summary's lines, as the command prints them."""
        done = self.earlier + self.answered
        head = f"run-batch: {done} of {self.requests} requests answered"
        if self.earlier:
            head += f" ({self.earlier} by an earlier run)"
        lines = [head + "."]
        if self.answered:
            rate = self.tokens_per_s
            text = (
                f"this run: {self.answered} requests in {self.seconds:.1f} s, "
                f"{self.completion_tokens} tokens generated"
                + (f", {rate:.1f} tokens/s" if rate is not None else "")
            )
            if self.acceptance_rate is not None:
                text += f", acceptance {self.acceptance_rate:.2f}"
            if self.speedup is not None:
                text += (
                    f"; decoding about {self.speedup:.2f}x the target alone's (estimated from "
                    "this run's measured forward times)"
                )
            lines.append(text + ".")
        if self.failures:
            shown = ", ".join(f"{cid} ({why})" for cid, why in self.failures[:5])
            more = f" and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
            lines.append(f"{len(self.failures)} answered with an error: {shown}{more}.")
        if self.interrupted:
            lines.append(
                f"interrupted: run the same command again to answer the other "
                f"{self.requests - done} (what {self.output} holds is kept)."
            )
        elif self.complete:
            lines.append(f"output: {self.output} (one line per request, in the input's order).")
        return lines


def failure(record: dict[str, Any]) -> str | None:
    """Why an output line is not an answer (None when it is one)."""
    if record.get("error"):
        return str(record["error"].get("code") or "error")
    response = record.get("response") or {}
    status = response.get("status_code")
    if status == 200:
        return None
    error = (response.get("body") or {}).get("error") or {}
    return f"{status} {error.get('code') or error.get('type') or ''}".strip()


def estimated_speedup(app: Any, tokens: int) -> float | None:
    """The run's decoding against the target alone's for the same `tokens` (those after each
    answer's first), from the forwards the run timed: the target alone would take one step per
    B of them, B the batch's mean rows, each step the run's mean target forward scaled by the
    measured policy's v(B) / v(n), n the mean rows the run's steps verified; against the
    target, draft and draft-prefill time the run spent. None where the policy measured nothing
    (a fixed policy, forwards untimed) or nothing was decoded."""
    state = app.state.server
    policy = state.worker.engine.k_policy
    meter = state.worker.session.batch.meter
    steps = meter.calls.get("target", 0)
    target_s = meter.seconds.get("target", 0.0)
    spent = target_s + meter.seconds.get("draft", 0.0) + meter.seconds.get("draft_prefill", 0.0)
    labels = {"model_name": state.model_name}
    rows = state.metrics.registry.get_sample_value("specdecode_batch_size_sum", labels)
    if not isinstance(policy, CostK) or not steps or not target_s or not rows or not tokens:
        return None
    mean_rows = rows / steps  # B
    verified = meter.tokens["target"] / steps  # n: B times (k + 1) for chains, tree nodes + 1
    scale = policy.verify_cost(round(mean_rows)) / policy.verify_cost(round(verified))
    alone = tokens / mean_rows * (target_s / steps) * scale
    return alone / spent


async def _answer(client: httpx.AsyncClient, request: BatchRequest) -> dict[str, Any] | None:
    """The output line for `request` (None: the server stopped before answering it)."""
    if request.error is not None:
        return error_line(request)
    reply = await client.post(
        request.url or "",
        content=json.dumps(request.body, ensure_ascii=False).encode("utf-8"),
        headers={"content-type": "application/json"},
    )
    if reply.status_code == RETRY_STATUS:
        return None
    try:
        body = reply.json()
    except ValueError:  # every answer of the app is JSON; kept as text should one not be
        body = {"error": {"message": reply.text, "type": "server_error"}}
    return answer_line(request.custom_id, reply.status_code, body)


async def _drive(
    app: Any,
    pending: PrefixOrder,
    output: ResumableOutput,
    summary: BatchSummary,
    workers: int,
    bar: tqdm,
) -> None:
    started = time.perf_counter()
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),  # starts the generation worker, stops it after
        httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client,
    ):

        async def work(taken: tuple[BatchRequest, Key] | None) -> None:
            while taken is not None:  # the order is shared: each worker takes the next
                request, key = taken
                record = await _answer(client, request)
                taken = pending.after(key)  # to the row this request leaves
                if record is None:
                    continue
                output.write(record)
                summary.count(record)
                summary.seconds = time.perf_counter() - started
                bar.update(1)
                rate, acceptance = summary.tokens_per_s, summary.acceptance_rate
                bar.set_postfix_str(
                    (f"{rate:.1f} tok/s" if rate is not None else "")
                    + (f", acceptance {acceptance:.2f}" if acceptance is not None else ""),
                    refresh=False,
                )

        tasks = [asyncio.ensure_future(work(first)) for first in pending.first(workers)]
        try:
            done, _ = (
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                if tasks
                else ((), ())
            )
            for task in done:
                task.result()  # the first failure (an output that cannot be written), if any
        finally:  # a failure or an interruption: the requests in flight stop unanswered
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            summary.seconds = time.perf_counter() - started


async def _main(app: Any, *args: Any) -> bool:
    """`_drive` until done; True when a signal (SIGINT, SIGTERM) stopped it."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    stopped: list[int] = []
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not main thread
            loop.add_signal_handler(sig, lambda s=sig: (stopped.append(s), task and task.cancel()))
            installed.append(sig)
    try:
        await _drive(app, *args)
    except asyncio.CancelledError:
        if not stopped:
            raise
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
    return bool(stopped)


def run_batch(
    engine: SpeculativeDecoder,
    input_path: Path,
    output_path: Path,
    *,
    model_name: str,
    max_batch: int = 8,
    max_len: int | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    timeout_s: float | None = None,
    max_prompt_tokens: int | None = None,
    max_prompt_chars: int | None = None,
    progress: bool = True,
) -> BatchSummary:
    """Answer every request of `input_path` not yet in `output_path` (batch_file.py) with
    `engine` served as `model_name`; BatchFileError for a file that cannot be used, before any
    request runs; OSError where the output cannot be written (the lines before it are kept)."""
    requests = read_requests(input_path, model_name)
    output = ResumableOutput(output_path, requests)
    summary = BatchSummary(output_path, len(requests), earlier=len(output.done))
    app = create_app(
        engine,
        model_name,
        queue_size=2 * max_batch,  # every request in flight fits: none is refused (429)
        max_batch=max_batch,
        max_len=max_len,
        prefill_chunk=prefill_chunk,
        prefix_cache_mb=prefix_cache_mb,
        timeout_s=timeout_s,
        max_prompt_tokens=max_prompt_tokens,
        max_prompt_chars=max_prompt_chars,
    )
    waiting = list(output.pending(requests))
    # the order needs every prompt's ids first: a large file takes a while to tokenize
    reading = tqdm(waiting, desc="reading prompts", unit="req", disable=not progress, leave=False)
    pending = PrefixOrder(waiting, [prompt_key(engine.encode_prompt, r) for r in reading])
    bar = tqdm(
        total=len(requests),
        initial=len(output.done),
        unit="req",
        desc="run-batch",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        summary.interrupted = asyncio.run(_main(app, pending, output, summary, max_batch, bar))
    finally:
        bar.close()
        output.close()
    summary.speedup = estimated_speedup(app, summary.decoded)
    summary.complete = output.complete
    if summary.complete:
        output.finish()
    summary.failures = [
        (cid, why) for cid, record in output.done.items() if (why := failure(record))
    ]
    summary.failures.sort(key=lambda item: output.order[item[0]])
    return summary
