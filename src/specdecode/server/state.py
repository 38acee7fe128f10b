"""What the routes share (`ServerState`): the options, the worker, the metrics, the prompt limits
known before tokenizing, and the drain that ends the server gracefully."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from specdecode.drafters.suffix import pool_of
from specdecode.runtime.engine import SpeculativeDecoder
from specdecode.runtime.session import DEFAULT_PREFIX_CACHE_MB
from specdecode.server.errors import APIError
from specdecode.server.limits import DEFAULT_MAX_BODY_BYTES, PREFILL_CHUNK, prompt_char_limit
from specdecode.server.responses import drafting_card
from specdecode.server.telemetry import ServerMetrics
from specdecode.server.worker import OPENAI_SAMPLING, GenerationWorker

DRAIN_POLL_S = 0.05
# after the graceful timeout, how long the step in progress may take to end (one step: a
# model's forward passes; a large model on a CPU takes seconds)
STEP_GRACE_S = 5.0

log = logging.getLogger("specdecode.server")


@dataclass(frozen=True)
class ServerOptions:
    """`max_batch`: generations decoding together (1: one at a time). `max_len`: positions per
    sequence in the key/value store (None: the model's context, at most
    batch_session.DEFAULT_MAX_LEN). `queue_size`: requests allowed to wait while the batch is
    full (more get 429). `timeout_s`:
    the limit per request from its arrival, queueing included (None: none). `max_prompt_tokens`:
    a limit below the model's context (None: the context only). `max_prompt_chars`: a limit in
    characters, checked before tokenizing (None: derived from the token limit, see limits.py).
    `max_body_bytes`: larger bodies get 413. `api_key`: required as `Authorization: Bearer` on
    /v1/* (and /metrics with `metrics_auth`). `prefill_chunk`: a longer prompt is prefilled in
    parts of that many tokens between the running rows' steps (0: at once; worker.py).
    `prefix_cache_mb`: host memory for the prompt prefixes freed rows held (0: only the rows';
    docs/architecture.md, "Prefix reuse")."""

    queue_size: int = 16
    max_batch: int = 8
    max_len: int | None = None
    timeout_s: float | None = 600.0
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    metrics_auth: bool = False
    prefill_chunk: int = PREFILL_CHUNK
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB

    def check(self) -> None:
        if self.queue_size < 0:
            raise ValueError(f"queue_size must be >= 0 (got {self.queue_size})")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1 (got {self.max_batch!r})")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be >= 2 positions (got {self.max_len})")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be an integer >= 0 (got {self.prefill_chunk!r})")
        if not self.prefix_cache_mb >= 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (got {self.prefix_cache_mb!r})")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds (got {self.timeout_s})")
        for name in ("max_prompt_tokens", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value})")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1 (got {self.max_body_bytes})")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        if self.metrics_auth and self.api_key is None:
            raise ValueError("metrics_auth needs an API key")


def sampling_card(engine: SpeculativeDecoder) -> dict[str, Any]:
    """What a request that leaves temperature, top_p and top_k unset runs with, and which of
    these values come from the model's generation config (the others are OpenAI's defaults)."""
    used = engine.sampling_params(fallback=OPENAI_SAMPLING)
    return {
        "temperature": used.temperature,
        "top_p": 1.0 if used.top_p is None else used.top_p,
        "top_k": used.top_k,  # None: no top-k
        "from_generation_config": sorted(engine.generation_defaults.as_dict()),
    }


def _smallest(*limits: int | None) -> int | None:
    known = [n for n in limits if n is not None]
    return min(known) if known else None


class ServerState:
    """What the routes share: the worker, the metrics, the limits, and whether the server drains."""

    def __init__(self, engine: SpeculativeDecoder, model_name: str, options: ServerOptions) -> None:
        self.options, self.model_name = options, model_name
        self.worker = GenerationWorker(
            engine,
            queue_size=options.queue_size,
            max_prompt_tokens=options.max_prompt_tokens,
            max_batch=options.max_batch,
            max_len=options.max_len,
            prefill_chunk=options.prefill_chunk,
            prefix_cache_mb=options.prefix_cache_mb,
        )
        session = self.worker.session
        log.info(
            "batch of up to %d sequences of %d positions: key/value store of %.1f MiB, "
            "freed rows' prefixes kept in up to %g MiB more",
            session.max_rows,
            session.max_len,
            session.store_bytes / 2**20,
            options.prefix_cache_mb,
        )
        self.metrics = ServerMetrics(
            model_name,
            lambda: self.worker.queue_depth,
            lambda: self.worker.running,
            store_bytes=session.store_bytes,
            pool=pool.report if (pool := pool_of(engine.drafter)) is not None else None,
            kept=kept.report if (kept := session.prefix_cache) is not None else None,
        )
        self.worker.metrics = self.metrics
        # the prompt limits known without tokenizing (the worker checks the exact count)
        self.max_prompt_tokens = _smallest(options.max_prompt_tokens, self.worker.position_limit)
        derived = prompt_char_limit(self.max_prompt_tokens, engine.tokenizer)
        self.max_prompt_chars = _smallest(options.max_prompt_chars, derived)
        self.generation_defaults = sampling_card(engine)
        self.drafting = drafting_card(engine)  # what drafts: usage.speculative says it
        self.draining = False

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "specdecode",
            "generation_defaults": self.generation_defaults,
        }

    async def drain(self, timeout_s: float) -> None:
        """Shut down gracefully: new generation requests, queued ones and those still sending
        their body get 503 and /health says "draining" at once; the running generations (and
        those joining the batch) may finish within `timeout_s`, then each is ended at its next
        step: a stream gets its last chunk with finish_reason "abort", an error event that says
        why (`server_shutdown`) and `[DONE]`; a non-streamed request gets 503. Returns at once
        when nothing runs, else once the worker is idle (or STEP_GRACE_S after the timeout)."""
        self.draining = True
        self.worker.drain()
        loop = asyncio.get_running_loop()
        if await self._until_idle(loop.time() + timeout_s):
            return
        log.warning("graceful timeout of %s s passed: ending the running generation", timeout_s)
        self.worker.interrupt_running("shutdown")
        await self._until_idle(loop.time() + STEP_GRACE_S)

    async def _until_idle(self, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        while not self.worker.idle:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True
