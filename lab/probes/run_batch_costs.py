"""Where a `run-batch` job's time goes: the engine's forwards by kind (target prefill, target
steps, draft prefill, draft forwards) and how many steps drafted which k, for one batch file
(its first `--limit` lines). Any other arguments are `specdecode run-batch`'s.

    python lab/probes/run_batch_costs.py lab/runs/run-batch-zen4/requests.jsonl --limit 64 \
        --target qwen2.5-coder-1.5b-instruct:int4 --draft qwen2.5-coder-0.5b-instruct:int4
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

from specdecode.cli import main as cli
from specdecode.core.batch import Batch
from specdecode.server import run_batch as rb

ks: Counter[int] = Counter()
step = Batch.step


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
    return estimate(app, tokens)


if __name__ == "__main__":
    source, limit, rest = Path(sys.argv[1]), 64, sys.argv[2:]
    if rest[:1] == ["--limit"]:
        limit, rest = int(rest[1]), rest[2:]
    lines = source.read_text().splitlines()[:limit]
    Batch.step = counted
    estimate, rb.estimated_speedup = rb.estimated_speedup, report
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "in.jsonl").write_text("\n".join(lines) + "\n")
        out = Path(tmp) / "out.jsonl"
        sys.exit(cli(["run-batch", "--input", f"{tmp}/in.jsonl", "--output", str(out),
                      "--quiet", *rest]))  # fmt: skip
