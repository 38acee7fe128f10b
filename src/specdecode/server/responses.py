"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from specdecode.core.types import Stats
from specdecode.server.logprobs import TokenLogprob, chat_logprobs, completion_logprobs

DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(outcome_reason: str) -> str:
    """OpenAI's finish_reason. A stream stopped by the timeout ends as "length": it was cut by a
    limit, not finished by the model."""
    return "stop" if outcome_reason == "stop" else "length"


def usage(stats: Stats) -> dict[str, Any]:
    """OpenAI usage plus the speculative counters of this request."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        # prompt positions kept from an earlier request's row, not prefilled (batch_session.py)
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": stats.accepted,
            # every drafted token the target checked and did not keep: for a token tree each node
            # off the accepted path (`drafted` counts a tree step's depth, not its nodes)
            "rejected_prediction_tokens": (stats.nodes_verified or stats.drafted) - stats.accepted,
        },
        "speculative": {
            "k_max": stats.k_max,
            "steps": stats.steps,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length,
        },
    }


class Shape:
    """The fields that differ between /v1/completions and /v1/chat/completions."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
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
        body["usage"] = usage(stats)
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
        body["usage"] = usage(stats)
        return body


def sse(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
