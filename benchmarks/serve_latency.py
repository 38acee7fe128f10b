"""Latency through the HTTP server: time to first token and total, speculative vs the target alone.

    python -m benchmarks.serve_latency --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --k 4 --requests 7 --max-tokens 64

Loads the models once and starts the server in-process twice, in turn: the target drafted by
`--draft`, then the target alone (same models, same prompts). Each server gets one warm-up
request, then `--requests` streamed greedy chat requests one after another (no concurrency: this
measures a request's latency, not throughput). Prints per request the time to the first content
token, the total time and the tokens, then the medians and the ratio of the medians. Times include
HTTP and SSE overhead, as a client sees them. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import httpx

from specdecode import SpeculativeDecoder, load_model
from specdecode.demo import DEMO_PROMPTS
from specdecode.drafters import resolve_draft
from specdecode.server.app import create_app
from specdecode.server.background import serve_in_thread

MODEL = "served"


@dataclass
class Timing:
    kind: str
    ttft_s: float  # request sent -> first non-empty content delta
    total_s: float  # request sent -> [DONE]
    tokens: int
    text: str


def stream_chat(
    http: httpx.Client, url: str, prompt: str, max_tokens: int
) -> tuple[float, float, int, str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    parts: list[str] = []
    tokens = 0
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    first = first if first is not None else time.perf_counter() - start
                    parts.append(content)
    total = time.perf_counter() - start
    return (first if first is not None else total), total, tokens, "".join(parts)


def measure(
    engine: SpeculativeDecoder, prompts: list[tuple[str, str]], max_tokens: int
) -> list[Timing]:
    with (
        serve_in_thread(create_app(engine, MODEL, timeout_s=None)) as url,
        httpx.Client(timeout=None) as http,
    ):
        stream_chat(http, url, "Hello!", 8)  # warm-up: first forwards, allocator, HTTP
        timings = []
        for kind, prompt in prompts:
            ttft, total, tokens, text = stream_chat(http, url, prompt, max_tokens)
            timings.append(Timing(kind, ttft, total, tokens, text))
            print(
                f"  {kind:<20} ttft {ttft:7.3f} s  total {total:7.3f} s  {tokens:4d} tokens",
                flush=True,
            )
    return timings


def summary(label: str, timings: list[Timing]) -> tuple[float, float]:
    ttft = statistics.median(t.ttft_s for t in timings)
    total = statistics.median(t.total_s for t in timings)
    print(f"{label}: median ttft {ttft:.3f} s, median total {total:.3f} s")
    return ttft, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--requests", type=int, default=len(DEMO_PROMPTS), help="prompts sent per server"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.requests)]
    target = load_model(args.target, dtype=args.dtype, device=args.device)
    draft = resolve_draft(args.draft, target, dtype=args.dtype, device=args.device)
    print(
        f"target {args.target}, draft {args.draft}, k={args.k}, {args.dtype}, "
        f"{args.requests} streamed chat requests of up to {args.max_tokens} tokens"
    )

    print(f"speculative (draft {args.draft}):")
    spec = measure(SpeculativeDecoder(target, draft, k=args.k), prompts, args.max_tokens)
    print("target alone:")
    alone = measure(SpeculativeDecoder(target), prompts, args.max_tokens)

    spec_ttft, spec_total = summary("speculative ", spec)
    alone_ttft, alone_total = summary("target alone", alone)
    identical = sum(s.text == a.text for s, a in zip(spec, alone, strict=True))
    print(
        f"median total latency, target alone / speculative: {alone_total / spec_total:.2f}x; "
        f"median ttft ratio: {alone_ttft / spec_ttft:.2f}x; "
        f"identical texts: {identical}/{len(spec)}"
    )


if __name__ == "__main__":
    main()
