"""Decoding on the thread that loaded the models against decoding on a worker thread, as the
server does, with the loader's OpenMP pool alive and released (kernels/openmp.py).

One process, one `BatchSession` of one row (the server's path: the target's static store),
greedy, the same prompts; each round runs every prompt three ways, one after the other:

- `main`: on the main thread, which loaded the models (its OpenMP pool the only one: the
  worker releases its own after each call);
- `worker`: on a long-lived worker thread, the main thread's pool still alive (two pools:
  the server before the fix);
- `worker, released`: the same worker after the main thread's `release_pool()` (the server now).

Prints decode tokens/s per way (the median over rounds and prompts) and the median of the
per-prompt ratios to `main`. Run it alone (2 cores: a parallel job corrupts the timings):

    python lab/probes/worker_thread.py --target qwen2.5-coder-1.5b-instruct:int4
    python lab/probes/worker_thread.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct:int4 --k 3
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable

from specdecode.kernels.openmp import release_pool

PROMPTS = (
    "Write a Python function that merges two sorted lists.",
    "Explain why the sky is blue to a ten year old.",
    "Translate into French: The weather is nice today and we will go for a walk.",
)
WAYS = ("main", "worker", "worker, released")


class Worker:
    """A long-lived thread that runs what it is given, one call at a time (as the server's),
    and then releases its OpenMP pool (so that the main thread's runs have theirs alone)."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[Callable[[], float], queue.Queue[float]]] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="worker").start()

    def _loop(self) -> None:
        while True:
            call, answer = self.calls.get()
            result = call()
            release_pool()
            answer.put(result)

    def run(self, call: Callable[[], float]) -> float:
        answer: queue.Queue[float] = queue.Queue()
        self.calls.put((call, answer))
        return answer.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--draft", default=None, help="a draft model (default: the target alone)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per generation")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from specdecode import SpeculativeDecoder, load_model
    from specdecode.core.request import GenerationRequest
    from specdecode.core.sampling import SamplingParams
    from specdecode.drafters import resolve_draft

    target = load_model(args.target, role="target")
    draft = resolve_draft(args.draft, target) if args.draft else None
    engine = SpeculativeDecoder(target, draft, k=args.k)
    session = engine.batch_session(1, 1024)

    def generate(prompt: str) -> float:
        """Decode tokens/s of one greedy generation (its prefill left out)."""
        request = GenerationRequest(args.tokens, SamplingParams(), 0, None, [], True)
        generation = session.add(prompt, request)
        start, first = time.perf_counter(), len(generation.token_ids)
        while not generation.finished:
            session.step()
        return (len(generation.token_ids) - first) / (time.perf_counter() - start)

    worker = Worker()
    generate(PROMPTS[0])  # warm-up, on both threads
    worker.run(lambda: generate(PROMPTS[0]))
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            rates["main"].append(generate(prompt))  # the main thread's pool, the only one
            rates["worker"].append(worker.run(lambda p=prompt: generate(p)))
            release_pool()
            rates["worker, released"].append(worker.run(lambda p=prompt: generate(p)))
            print("  ".join(f"{way} {rates[way][-1]:.2f}" for way in WAYS), flush=True)
    setting = f"{args.target}" + (f" + {args.draft}, k = {args.k}" if args.draft else " alone")
    print(f"\n{setting}, {args.tokens} new tokens, {args.rounds} rounds of {len(PROMPTS)}")
    print("\n| way | decode tok/s (median) | ratio to main (median) |\n|---|---:|---:|")
    for way in WAYS:
        ratios = [r / m for r, m in zip(rates[way], rates["main"], strict=True)]
        median = statistics.median(rates[way])
        print(f"| {way} | {median:.2f} | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
