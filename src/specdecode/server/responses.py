"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from specdecode.core.metrics import ratio
from specdecode.core.tree import TreeDrafter
from specdecode.core.types import Stats
from specdecode.server.errors import APIError, shutting_down
from specdecode.server.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from specdecode.server.telemetry import finished_reason

if TYPE_CHECKING:
    from specdecode.runtime.engine import SpeculativeDecoder

DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(outcome_reason: str) -> str:
    """OpenAI's finish_reason for a worker outcome: "stop" (EOS or a stop string), "length"
    (max_tokens, or the end of the context), else "abort", vLLM's value for a request the server
    ended (shutdown, the per-request timeout, the client gone). "length" stays a real limit: a
    client may take it as "ask for more tokens". The same values label
    vllm:request_success_total (telemetry.finished_reason)."""
    return finished_reason(outcome_reason)


def interruption(outcome_reason: str) -> APIError | None:
    """Why the server ended a generation before it finished ("abort"), as the error a stream
    sends after its last chunk (and a non-streamed request gets instead of its text); None
    for a generation that finished ("stop", "length") or whose client is gone."""
    if outcome_reason == "shutdown":
        return shutting_down(
            "the server is shutting down: the generation was ended before it finished"
        )
    if outcome_reason == "timeout":
        return APIError(
            504,
            "the generation was ended at the server's per-request timeout (--timeout)",
            type="timeout",
            code="timeout",
        )
    return None


def drafting_card(engine: SpeculativeDecoder) -> dict[str, Any]:
    """What drafts for `engine`'s requests, as `usage.speculative` reports it: `drafter` "tree",
    "chain" or None (no draft); for a token tree its shape (`tree`, e.g.
    "dynamic:11,8,3,0.2,0.05", or the drafter's name where it shapes its own: "suffix") and
    `tree_depth`, the most tokens one step may accept (None where each step decides)."""
    drafter = engine.drafter
    if drafter is None:
        return {"drafter": None, "tree": None, "tree_depth": None}
    if isinstance(drafter, TreeDrafter):
        shape = getattr(drafter, "shape", None)  # TreeModelDrafter's; another tree may have none
        depth = getattr(shape, "max_depth", None)
        return {
            "drafter": "tree",
            # a drafter that shapes its own trees (suffix, hybrid) names itself
            "tree": drafter.name if shape is None else str(shape),
            "tree_depth": depth,
        }
    return {"drafter": "chain", "tree": None, "tree_depth": None}


def usage(stats: Stats, drafting: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI usage plus the speculative counters of this request and what drafted them
    (`drafting`: `drafting_card(engine)`; without it only the counters say what ran)."""
    if drafting is None:  # what the counters tell: a tree verifies nodes, a chain has a k_max
        kind = "tree" if stats.nodes_verified else "chain" if stats.k_max else None
        drafting = {"drafter": kind, "tree": None, "tree_depth": None}
    tree = drafting["drafter"] == "tree"
    # every drafted token the target checked: for a token tree its nodes (`drafted` counts a tree
    # step's depth, the most it can accept, so that accepted / drafted stays the acceptance rate)
    verified = stats.nodes_verified or stats.drafted
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        # prompt positions kept from an earlier request's row, not prefilled (runtime/session.py)
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": stats.accepted,
            # every drafted token the target checked and did not keep: for a token tree each node
            # off the accepted path
            "rejected_prediction_tokens": verified - stats.accepted,
        },
        "speculative": {
            **drafting,
            # the most tokens a step may accept: a chain's k policy's k_max, a tree's depth (the
            # tree ignores the chain's k); 0 without a draft
            "k_max": drafting["tree_depth"] if tree else stats.k_max,
            "k_policy": (stats.k_policy or None) if not tree else None,
            "steps": stats.steps,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "nodes_verified": verified,
            "nodes_per_step": ratio(verified, stats.steps),
            "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length,
        },
    }


class Shape:
    """The fields that differ between /v1/completions and /v1/chat/completions."""

    def __init__(self, chat: bool, model: str, drafting: dict[str, Any] | None = None) -> None:
        self.chat, self.model = chat, model
        self.drafting = drafting  # drafting_card(engine): what `usage` says drafted
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._offset = 0  # a completion stream's characters of logprobs tokens so far

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        body = completion_logprobs(entries, self._offset)
        self._offset += sum(len(e.token) for e in entries)
        return body

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(
        self,
        text: str,
        reason: str,
        stats: Stats,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text}
            body = self._envelope("text_completion", [choice])
        choice.update(logprobs=self._logprobs(logprobs), finish_reason=finish_reason(reason))
        body["usage"] = usage(stats, self.drafting)
        return body

    def chunk(
        self,
        text: str | None,
        reason: str | None = None,
        *,
        role: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk: new text (and its tokens' logprobs, where asked for), or
        (text=None) the last one with its finish_reason."""
        done = None if reason is None else finish_reason(reason)
        lp = self._logprobs(logprobs)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": done}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": done}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, stats: Stats) -> dict[str, Any]:
        """The chunk OpenAI sends last when stream_options.include_usage is true: no choices."""
        object_name = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(object_name, [])
        body["usage"] = usage(stats, self.drafting)
        return body


def sse(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
