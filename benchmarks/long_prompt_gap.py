"""A running stream's longest wait for its next token while a long prompt joins the server,
with the prompt prefilled at once against in parts (`--prefill-chunk`).

    python -m benchmarks.long_prompt_gap --target qwen2.5-coder-1.5b-instruct:int4 \\
        --draft qwen2.5-coder-0.5b-instruct:int4 --long-tokens 1000 --rounds 2

Loads the models once; per round and setting (alternating), starts the server in-process, streams
a greedy chat request (the "running stream"), and once it has received `--after` tokens posts a
completion whose prompt is `--long-tokens` tokens long (8 new tokens). Prints the running
stream's longest gap between two tokens, its median gap, the long request's time to its answer,
and whether the running stream's text is the same in every setting. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time

import httpx

from specdecode import SpeculativeDecoder, load_model
from specdecode.drafters import resolve_draft
from specdecode.server.app import create_app
from specdecode.server.background import serve_in_thread

MODEL = "served"
STREAM_PROMPT = "Write a Python function that merges two sorted lists, with a docstring."
FILLER = (
    "The quarterly report covers revenue, costs, hiring and the risks the board discussed. "
    "Revenue grew in every region except the north, where a supplier failed in the spring. "
)


def long_prompt(engine: SpeculativeDecoder, tokens: int) -> str:
    """A plain-text prompt of about `tokens` tokens (the filler repeated), then a question."""
    text = FILLER
    while len(engine.encode_prompt(text, chat=False)) < tokens:
        text += FILLER
    return text + "\nSummarize the report in one sentence:"


def one_round(
    engine: SpeculativeDecoder, chunk: int, prompt: str, after: int, max_tokens: int
) -> dict:
    arrivals: list[float] = []
    text: list[str] = []
    joined = threading.Event()
    long_done: dict = {}
    app = create_app(engine, MODEL, timeout_s=None, prefill_chunk=chunk, max_len=2048)
    with serve_in_thread(app) as url, httpx.Client(timeout=None) as http:
        http.post(  # warm-up
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}
        )

        def post_long() -> None:
            start = time.perf_counter()
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            http.post(f"{url}/v1/completions", json=body).raise_for_status()
            long_done["seconds"] = time.perf_counter() - start
            long_done["at"] = start

        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": STREAM_PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        poster = threading.Thread(target=post_long)
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    if choice["delta"].get("content"):
                        arrivals.append(time.perf_counter())
                        text.append(choice["delta"]["content"])
                if len(arrivals) == after and not joined.is_set():
                    joined.set()
                    poster.start()
        poster.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "max_gap": max(gaps),
        "median_gap": statistics.median(gaps),
        "long_s": long_done["seconds"],
        "text": "".join(text),
        "tokens": len(arrivals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--chunks", default="0,128", help="--prefill-chunk settings compared")
    parser.add_argument("--after", type=int, default=8, help="stream tokens before the long one")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    target = load_model(args.target)
    draft = resolve_draft(args.draft, target)
    engine = SpeculativeDecoder(target, draft)
    prompt = long_prompt(engine, args.long_tokens)
    n_long = len(engine.encode_prompt(prompt, chat=False))
    chunks = [int(c) for c in args.chunks.split(",")]
    print(
        f"target {args.target}, draft {args.draft}; a stream of up to {args.max_tokens} tokens, "
        f"a {n_long}-token prompt joining after its {args.after}th token"
    )
    results: dict[int, list[dict]] = {c: [] for c in chunks}
    for round_ in range(args.rounds):
        for chunk in chunks:
            r = one_round(engine, chunk, prompt, args.after, args.max_tokens)
            results[chunk].append(r)
            print(
                f"  round {round_ + 1}, --prefill-chunk {chunk}: longest gap {r['max_gap']:.2f} s, "
                f"median gap {r['median_gap']:.3f} s, the long request {r['long_s']:.2f} s, "
                f"{r['tokens']} stream tokens",
                flush=True,
            )
    texts = {r["text"] for rs in results.values() for r in rs}
    print("| --prefill-chunk | longest gap (s) | median gap (s) | long request (s) |")
    print("|---:|---:|---:|---:|")
    for chunk, rs in results.items():
        print(
            f"| {chunk} | {statistics.median(r['max_gap'] for r in rs):.2f} | "
            f"{statistics.median(r['median_gap'] for r in rs):.3f} | "
            f"{statistics.median(r['long_s'] for r in rs):.2f} |"
        )
    print(f"the running stream's text the same in every run: {len(texts) == 1}")


if __name__ == "__main__":
    main()
