"""The server's metrics: what `GET /metrics` exports (Prometheus text format, see prom.py).

Request counters are taken when a response starts (so a client never sees its answer before it is
counted); generation counters when a generation ends, on the worker thread, before its last event.
"""

from __future__ import annotations

from collections.abc import Callable

from specdecode.server.prom import Counter, Gauge, Histogram, Registry
from specdecode.types import Stats

# seconds: a tiny model answers in milliseconds, a 1.5B model on a CPU in tens of seconds
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float]) -> None:
        self.registry = Registry()
        add = self.registry.add
        self.requests = add(
            Counter(
                "specdecode_requests_total",
                "HTTP requests answered, by endpoint and status code",
                ("endpoint", "status"),
            )
        )
        self.generations = add(
            Counter(
                "specdecode_generations_total",
                "generations ended, by endpoint and outcome (stop, length, timeout, cancelled)",
                ("endpoint", "outcome"),
            )
        )
        self.prompt_tokens = add(
            Counter("specdecode_prompt_tokens_total", "prompt tokens of the generations run")
        )
        self.completion_tokens = add(
            Counter("specdecode_completion_tokens_total", "tokens generated")
        )
        self.steps = add(Counter("specdecode_speculative_steps_total", "target verification steps"))
        self.drafted = add(Counter("specdecode_drafted_tokens_total", "tokens drafted"))
        self.accepted = add(Counter("specdecode_accepted_tokens_total", "drafted tokens accepted"))
        self.drafted_at = add(
            Counter(
                "specdecode_drafted_at_position_total",
                "steps that drafted a token at this position (1 = first drafted token)",
                ("position",),
            )
        )
        self.accepted_at = add(
            Counter(
                "specdecode_accepted_at_position_total",
                "steps whose drafted token at this position was accepted",
                ("position",),
            )
        )
        self.latency = add(
            Histogram(
                "specdecode_request_duration_seconds",
                "from a generation request's arrival to its last token (queueing included)",
                LATENCY_BUCKETS,
                ("endpoint",),
            )
        )
        self.ttft = add(
            Histogram(
                "specdecode_time_to_first_token_seconds",
                "from a generation request's arrival to its first token (queueing included)",
                LATENCY_BUCKETS,
                ("endpoint",),
            )
        )
        add(
            Gauge(
                "specdecode_queue_depth", "requests waiting for the generation worker", queue_depth
            )
        )
        add(Gauge("specdecode_requests_running", "generations running (0 or 1)", running))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.inc(endpoint=endpoint, status=str(status))

    def count_generation(
        self,
        endpoint: str,
        outcome: str,
        stats: Stats | None,
        duration_s: float | None,
        ttft_s: float | None,
    ) -> None:
        """One generation ended; `stats` is None when it never started (cancelled in the queue)."""
        self.generations.inc(endpoint=endpoint, outcome=outcome)
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(stats.new_tokens)
        self.steps.inc(stats.steps)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        for i, (drafted, accepted) in enumerate(
            zip(stats.drafted_at, stats.accepted_at, strict=True), 1
        ):
            self.drafted_at.inc(drafted, position=str(i))
            self.accepted_at.inc(accepted, position=str(i))
        if duration_s is not None:
            self.latency.observe(duration_s, endpoint=endpoint)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, endpoint=endpoint)

    def render(self) -> str:
        return self.registry.render()
