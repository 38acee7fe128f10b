"""A server's speculative-decoding counters, read from its Prometheus endpoint (`GET /metrics`).

The names are vLLM's (`vllm:spec_decode_*`), which our server exports too; SGLang, llama-server
and servers without speculation export none of them, and then `scrape` says so (None) and the
lab reports speed alone. Counters only grow, so what a piece of work drafted and accepted is the
difference of two scrapes around it (`Counters.minus`), exact when nothing else used the server
meanwhile.

- `drafts`: steps that drafted at least one token (vLLM's `num_drafts`);
- `draft_tokens`, `accepted`: tokens drafted and accepted over those steps;
- `accepted_at[i]`: tokens accepted at draft position i (0 = the first drafted token);
- `drafted_at[i]`: steps that drafted a token at position i, where the server says
  (ours: `specdecode_spec_decode_num_draft_tokens_per_pos`); else None.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.bench.serve_client import Endpoint, get

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_AT = "vllm:spec_decode_num_accepted_tokens_per_pos"
DRAFTED_AT = "specdecode_spec_decode_num_draft_tokens_per_pos"
METRICS_ROUTE = "/metrics"


@dataclass(frozen=True)
class Counters:
    """A server's speculative counters at one moment (or the difference of two moments)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_at: tuple[float, ...] = ()
    drafted_at: tuple[float, ...] | None = None

    def minus(self, earlier: Counters) -> Counters:
        """What happened between `earlier` and this scrape."""
        return _combine(self, earlier, -1.0)

    def plus(self, other: Counters) -> Counters:
        """Two differences together (a request and the late counts that followed it)."""
        return _combine(self, other, 1.0)


def _combine(a: Counters, b: Counters, sign: float) -> Counters:
    def positions(x: tuple[float, ...], y: tuple[float, ...]) -> tuple[float, ...]:
        width = max(len(x), len(y))
        x, y = x + (0.0,) * (width - len(x)), y + (0.0,) * (width - len(y))
        return tuple(p + sign * q for p, q in zip(x, y, strict=True))

    drafted_at = None
    if a.drafted_at is not None and b.drafted_at is not None:
        drafted_at = positions(a.drafted_at, b.drafted_at)
    return Counters(
        a.drafts + sign * b.drafts,
        a.draft_tokens + sign * b.draft_tokens,
        a.accepted + sign * b.accepted,
        positions(a.accepted_at, b.accepted_at),
        drafted_at,
    )


def parse_counters(text: str, model: str | None = None) -> Counters | None:
    """The speculative counters in Prometheus text `text` (summed over the series of `model`,
    or of every model when None or when a series names none); None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_position: dict[str, dict[int, float]] = {ACCEPTED_AT: {}, DRAFTED_AT: {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if sample.name.endswith("_created"):
                continue  # the time a series was created, not a count
            labels = sample.labels
            if model is not None and labels.get("model_name", model) != model:
                continue
            if name in per_position:
                position = int(labels.get("position", 0))
                table = per_position[name]
                table[position] = table.get(position, 0.0) + sample.value
            elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                totals[name] = totals.get(name, 0.0) + sample.value
    if DRAFT_TOKENS not in totals and ACCEPTED not in totals:
        return None

    def listed(table: dict[int, float]) -> tuple[float, ...]:
        return tuple(table.get(i, 0.0) for i in range(max(table) + 1)) if table else ()

    drafted_at = per_position[DRAFTED_AT]
    return Counters(
        totals.get(DRAFTS, 0.0),
        totals.get(DRAFT_TOKENS, 0.0),
        totals.get(ACCEPTED, 0.0),
        listed(per_position[ACCEPTED_AT]),
        listed(drafted_at) if drafted_at else None,
    )


def scrape(endpoint: Endpoint, model: str | None, timeout_s: float = 10.0) -> Counters | None:
    """The server's counters now; None when it has no /metrics or no speculative counters
    (a server that cannot be reached raises ValueError: the counts would be wrong)."""
    status, raw = get(endpoint, METRICS_ROUTE, timeout_s)
    if status != 200:
        return None
    try:
        return parse_counters(raw.decode("utf-8", errors="replace"), model)
    except ValueError:
        return None  # not Prometheus text: a server without counters
