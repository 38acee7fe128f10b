"""Where a `run-batch` job's time goes: the engine's forwards by kind (target prefill, target
steps, draft prefill, draft forwards) and how many steps drafted which k, for one batch file
(its first `--limit` lines). Any other arguments are `specdecode run-batch`'s.

    python lab/probes/run_batch_costs.py lab/runs/run-batch-zen4/requests.jsonl --limit 64 \
        --target qwen2.5-coder-1.5b-instruct:int4 --draft qwen2.5-coder-0.5b-instruct:int4
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from specdecode.cli import main as cli
from specdecode.core.batch import Batch
from specdecode.runtime.session import BatchSession
from specdecode.server import run_batch as rb

ks: Counter[int] = Counter()
step = Batch.step
# wall seconds and calls of the session's prefill entry points (a prompt at once, in parts)
walls: Counter[str] = Counter()
calls: Counter[str] = Counter()


def timed(name: str, method):
    def wrapper(*args, **kwargs):
        before = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            walls[name] += time.perf_counter() - before
            calls[name] += 1

    return wrapper


def counted(self: Batch) -> list:
    stepped = step(self)
    if stepped:
        ks[self.last_k] += 1
    return stepped


def report(app, tokens):  # run_batch's estimated_speedup, and what it reads
    meter = app.state.server.worker.session.batch.meter
    print("forwards: kind, calls, tokens, seconds")
    for kind in sorted(meter.calls):
        print(
            f"  {kind:14s} {meter.calls[kind]:6d} {meter.tokens.get(kind, 0):8d} "
            f"{meter.seconds.get(kind, 0.0):8.1f}"
        )
    print("steps by k:", dict(sorted(ks.items())))
    print("session wall: name, calls, seconds (add: a prompt's prefill and its first token)")
    for name in sorted(walls):
        print(f"  {name:14s} {calls[name]:6d} {walls[name]:8.1f}")
    return estimate(app, tokens)


if __name__ == "__main__":
    source, limit, rest = Path(sys.argv[1]), 64, sys.argv[2:]
    if rest[:1] == ["--limit"]:
        limit, rest = int(rest[1]), rest[2:]
    lines = source.read_text().splitlines()[:limit]
    Batch.step = counted
    for name in ("add", "advance_prefill", "step"):
        setattr(BatchSession, name, timed(name, getattr(BatchSession, name)))
    estimate, rb.estimated_speedup = rb.estimated_speedup, report
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "in.jsonl").write_text("\n".join(lines) + "\n")
        out = Path(tmp) / "out.jsonl"
        sys.exit(cli(["run-batch", "--input", f"{tmp}/in.jsonl", "--output", str(out),
                      "--quiet", *rest]))  # fmt: skip
