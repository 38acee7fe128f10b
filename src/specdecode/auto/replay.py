"""Replay a greedy drafter against the target's answer: per step, the tokens emitted, the rows of
each draft forward and the rows the target would verify, exactly, with no target forward.

Greedy speculative decoding emits the target's greedy answer (exactly in float32; in bfloat16 up
to near-ties), and a drafted token is accepted iff it is the answer's next token: so a recorded
answer says what every step of any greedy drafter accepts. `replay` runs the real drafter (its
draft forwards) and the core's greedy verification on one-hot "target logits" built from the
answer. benchmarks/tree_replay.py replays recorded bench runs with it; the calibration
(calibrate.py) replays its candidate trees on the answers of its own chain run.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingParams
from specdecode.core.types import ForwardMeter
from specdecode.core.verify import verify_greedy
from specdecode.core.verify_tree import verify_tree_greedy


def one_hot(rows: list[int]) -> torch.Tensor:
    """[len(rows), max(rows) + 1] logits whose argmax in row i is rows[i]."""
    logits = torch.zeros(len(rows), max(rows) + 1)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 1.0
    return logits


class RowMeter(ForwardMeter):
    """A ForwardMeter that also keeps the rows (new tokens) of every draft forward, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.draft_rows: list[int] = []

    def forward(self, kind: str, n_tokens: int):  # type: ignore[override]
        if kind == "draft":
            self.draft_rows.append(n_tokens)
        return super().forward(kind, n_tokens)


def replay(engine, ids: list[int], answer: list[int], k: int) -> list[tuple[int, list[int], int]]:
    """Every step of `engine`'s drafter (a SpeculativeDecoder's) on `answer`, the target's greedy
    continuation of `ids`: (emitted, the rows of each draft forward, verified rows). The
    answer's first token is the prefill's (no step), as in the engine."""
    drafter = engine.drafter
    meter = RowMeter()
    context, pos, steps = [*ids, *answer[:1]], 1, []
    drafter.begin(context, SamplingParams(temperature=0.0), None, meter)
    while pos < len(answer):
        forwards = len(meter.draft_rows)
        left = len(answer) - pos - 1  # the most drafted tokens this step can still use
        if not left:  # one token to go: a plain target step, as the engine takes it
            n_rows, n_accepted = 1, 0
        elif hasattr(drafter, "propose_tree"):
            tree = drafter.propose_tree(context, left)
            # row r of the tree asks for the answer's token at its depth
            targets = [answer[pos + d] for d in [0, *tree.depth.tolist()]]
            path, _ = verify_tree_greedy(tree, one_hot(targets))
            drafter.observe_path(path)
            n_rows, n_accepted = len(tree) + 1, len(path)
        else:
            tokens = drafter.propose(context, min(k, left)).tokens
            targets = answer[pos : pos + len(tokens) + 1]
            n_accepted, _ = verify_greedy(tokens, one_hot(targets))
            drafter.observe(n_accepted)
            n_rows = len(tokens) + 1
        committed = answer[pos : pos + n_accepted + 1]
        context += committed
        pos += len(committed)
        steps.append((len(committed), meter.draft_rows[forwards:], n_rows))
    return steps
