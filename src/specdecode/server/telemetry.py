"""The server's metrics: what `GET /metrics` exports, on `prometheus_client`.

Names follow vLLM's where they mean the same thing (`vllm:...`), so a vLLM dashboard works
unchanged; the series only specdecode has are named `specdecode_...`. Every series carries a
`model_name` label. The mapping is documented in docs/server.md, "Metrics".

Each app owns its `CollectorRegistry` (never prometheus_client's global one), so a process can hold
several apps (tests do). Request counters are taken when a response starts (a client never sees
its answer before it is counted); generation counters when a generation ends, on the worker thread,
before its last event.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specdecode.core.types import Stats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# seconds: a tiny model answers in milliseconds, a 1.5B model on a CPU in tens of seconds
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
# tokens per request, 1-2-5 steps as vLLM's
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
# tokens a step asks every row to draft (the k policy's choice; 0: no drafting)
K_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))

# vLLM's finished_reason values, and the finish_reason a client sees (responses.finish_reason):
# "stop" (EOS, stop string), "length" (max_tokens, the context's end); specdecode's other
# outcomes (timeout, cancelled by the client, shutdown, error) are all an "abort" there
FINISHED_REASONS = ("stop", "length", "abort")


def finished_reason(outcome: str) -> str:
    """The finished_reason label (and OpenAI finish_reason) of a worker outcome."""
    return outcome if outcome in ("stop", "length") else "abort"


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        queue_depth: Callable[[], float],
        running: Callable[[], float],
        store_bytes: float = 0.0,
        pool: Callable[[], dict[str, int]] | None = None,
        kept: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._vllm_series()
        self._specdecode_series()
        self.running = self._gauge(
            "vllm:num_requests_running", "generations running (in the batch)", running
        )
        self.store_bytes = self._gauge(
            "specdecode_kv_store_bytes",
            "bytes of the target's preallocated key/value store",
            lambda: store_bytes,
        )
        if pool is not None:  # a suffix draft's pool of earlier outputs (drafters/suffix.py)
            self.pool_tokens = self._gauge(
                "specdecode_suffix_pool_tokens",
                "tokens of earlier outputs the suffix pool holds (at most its pool-tokens)",
                lambda: pool()["tokens"],
            )
            self.pool_bytes = self._gauge(
                "specdecode_suffix_pool_bytes",
                "bytes the suffix pool holds, roughly (its tokens and their index)",
                lambda: pool()["bytes"],
            )
        if kept is not None:  # the prefixes freed rows held (models/prefix_cache.py)
            self.kept_bytes = self._gauge(
                "specdecode_prefix_cache_bytes",
                "bytes of host memory holding the target's keys and values of prompt prefixes "
                "freed rows left (with a draft model's caches, at most --prefix-cache-mb)",
                lambda: kept()["bytes"],
            )
            self.kept_prefixes = self._gauge(
                "specdecode_prefix_cache_prefixes",
                "prompt prefixes held beyond the key/value store's rows",
                lambda: kept()["prefixes"],
            )
        self.batch_size = self._histogram(
            "specdecode_batch_size", "generations in the batch at each step", BATCH_BUCKETS
        )
        self.step_k = self._histogram(
            "specdecode_step_k",
            "tokens each batched step asked every row to draft (the k policy's choice; 0: none)",
            K_BUCKETS,
        )
        self.waiting = self._gauge(
            "vllm:num_requests_waiting", "requests waiting for the generation worker", queue_depth
        )

    # -- the series --------------------------------------------------------------------------

    def _counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, help, ("model_name", *labels), registry=self.registry)

    def _histogram(self, name: str, help: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(name, help, ("model_name",), buckets=buckets, registry=self.registry)
        return metric.labels(model_name=self.model_name)

    def _gauge(self, name: str, help: str, read: Callable[[], float]) -> Gauge:
        gauge = Gauge(name, help, ("model_name",), registry=self.registry)
        child = gauge.labels(model_name=self.model_name)
        child.set_function(read)  # read at scrape time
        return child

    def _vllm_series(self) -> None:
        model = self.model_name
        self.prompt_tokens = self._counter(
            "vllm:prompt_tokens", "prompt tokens of the generations run"
        ).labels(model_name=model)
        self.generation_tokens = self._counter("vllm:generation_tokens", "tokens generated").labels(
            model_name=model
        )
        success = self._counter(
            "vllm:request_success",
            "generations ended, by finished_reason (stop, length, abort)",
            ("finished_reason",),
        )
        self.success = {
            r: success.labels(model_name=model, finished_reason=r) for r in FINISHED_REASONS
        }
        self.drafts = self._counter(
            "vllm:spec_decode_num_drafts", "speculative steps that drafted at least one token"
        ).labels(model_name=model)
        self.draft_tokens = self._counter(
            "vllm:spec_decode_num_draft_tokens", "tokens drafted"
        ).labels(model_name=model)
        self.accepted_tokens = self._counter(
            "vllm:spec_decode_num_accepted_tokens", "drafted tokens accepted"
        ).labels(model_name=model)
        self.accepted_per_pos = self._counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "drafted tokens accepted at this position (0 = the first drafted token)",
            ("position",),
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "from a generation request's arrival to its first token (queueing included)",
            LATENCY_BUCKETS,
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "from a generation request's arrival to its last token (queueing included)",
            LATENCY_BUCKETS,
        )
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "from a generation request's arrival to the start of its generation",
            LATENCY_BUCKETS,
        )
        self.prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds",
            "from the start of a generation (it left the queue) to its first token: its prefill, "
            "after those of requests that joined the batch just before it",
            LATENCY_BUCKETS,
        )
        self.decode_time = self._histogram(
            "vllm:request_decode_time_seconds",
            "from a generation's first token to its last",
            LATENCY_BUCKETS,
        )
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries",
            "prompt tokens of the generations run, each a query for a kept prefix",
        ).labels(model_name=model)
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits",
            "prompt positions kept from an earlier request's row (not prefilled)",
        ).labels(model_name=model)
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "prompt tokens per generation", TOKEN_BUCKETS
        )
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "tokens generated per generation", TOKEN_BUCKETS
        )

    def _specdecode_series(self) -> None:
        self.requests = self._counter(
            "specdecode_requests",
            "HTTP requests answered, by endpoint and status code",
            ("endpoint", "status"),
        )
        self.generations = self._counter(
            "specdecode_generations",
            "generations ended, by endpoint and outcome "
            "(stop, length, timeout, cancelled, shutdown, error)",
            ("endpoint", "outcome"),
        )
        self.steps = self._counter(
            "specdecode_speculative_steps", "target verification steps"
        ).labels(model_name=self.model_name)
        self.tree_nodes = self._counter(
            "specdecode_tree_nodes_verified",
            "token-tree nodes the target verified (a tree step's drafted tokens count its depth)",
        ).labels(model_name=self.model_name)
        self.draft_per_pos = self._counter(
            "specdecode_spec_decode_num_draft_tokens_per_pos",
            "steps that drafted a token at this position (0 = the first drafted token): "
            "the denominator of the per-position acceptance rate when k varies",
            ("position",),
        )

    # -- updates -----------------------------------------------------------------------------

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(
            model_name=self.model_name, endpoint=endpoint, status=str(status)
        ).inc()

    def count_generation(
        self,
        endpoint: str,
        outcome: str,
        stats: Stats | None,
        duration_s: float | None = None,
        ttft_s: float | None = None,
        queue_s: float | None = None,
    ) -> None:
        """One generation ended; `stats` is None when it never started (ended in the queue)."""
        model = self.model_name
        self.generations.labels(model_name=model, endpoint=endpoint, outcome=outcome).inc()
        self.success[finished_reason(outcome)].inc()
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefix_queries.inc(stats.prompt_tokens)
        self.prefix_hits.inc(stats.cached_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.request_prompt_tokens.observe(stats.prompt_tokens)
        self.request_generation_tokens.observe(stats.new_tokens)
        self.steps.inc(stats.steps)
        self.draft_tokens.inc(stats.drafted)
        self.tree_nodes.inc(stats.nodes_verified)
        self.accepted_tokens.inc(stats.accepted)
        self.drafts.inc(stats.drafted_at[0] if stats.drafted_at else 0)
        for pos, (drafted, accepted) in enumerate(
            zip(stats.drafted_at, stats.accepted_at, strict=True)
        ):
            self.draft_per_pos.labels(model_name=model, position=str(pos)).inc(drafted)
            self.accepted_per_pos.labels(model_name=model, position=str(pos)).inc(accepted)
        prefill_s = ttft_s - queue_s if ttft_s is not None and queue_s is not None else None
        decode_s = duration_s - ttft_s if duration_s is not None and ttft_s is not None else None
        for histogram, value in (
            (self.e2e, duration_s),
            (self.ttft, ttft_s),
            (self.queue_time, queue_s),
            (self.prefill_time, prefill_s),
            (self.decode_time, decode_s),
        ):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
