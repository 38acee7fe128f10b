"""The server's own CPU time per streamed token, against the output's length: the text path
before and after incremental detokenization (docs/server.md, "Streaming").

    python lab/probes/stream_cost.py                        # 100, 500, 1000, 2000, 4000 tokens
    python lab/probes/stream_cost.py --lengths 20 --repeats 1   # a quick check that it runs

Each generation runs in-process on the server's worker code, with SmolLM2-135M's tokenizer (the
preset, fetched once) and a tiny random Llama over its vocabulary, whose forwards cost little and
whose context allows the longest length; EOS is ignored, so every generation has exactly the
asked length. Three paths per length, greedy, the same ids in each:

- `model`: the engine's steps alone, no text: the model's share of the time;
- `old`: the text path before textstream.py, kept here for comparison: every step decodes every
  generated id twice (the engine's stop check and the server's text stream), and the whole text
  is searched for the stop string;
- `new`: `GenerationWorker`'s own loop: one `TextStream` per generation, fed by the engine, one
  small window decoded per step, stop strings matched over the tail.

Every path but `model` has one stop string that never appears (`--stop`), so the stop check runs
every step. CPU time is `time.process_time` (this process, all threads; torch runs on one): the
text columns add it up around the text calls only (decoding, stop matching, what to send), so the
model's forwards are left out; `total` is the whole generation, the worker's per-step work
included. Each is the best of `--repeats`, per token. Run it alone on a quiet machine; the results
go to lab/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdecode import GenerationRequest, SamplingParams, SpeculativeDecoder
from specdecode.models.loading import wrap_model
from specdecode.runtime.textstream import TextStream
from specdecode.server.worker import Finished, GenerationParams, GenerationWorker, Job

PRESET = "smollm2-135m-instruct"
PROMPT = "Tell me a long story about a lighthouse keeper."
NEVER = "<|never stops|>"


# -- the text path before textstream.py, for comparison ---------------------------------------


class OldStopStrings:
    """engine._StopStrings before textstream.py: the whole output decoded after every step."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []

    def _hit(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def feed(self, committed: list[int]) -> list[int] | None:
        before = len(self.ids)
        self.ids.extend(committed)
        if not self._hit(self.ids):
            return None
        for n in range(1, len(committed) + 1):
            if self._hit(self.ids[: before + n]):
                return committed[:n]
        return committed


class OldIncrementalText:
    """server/textstream.py's IncrementalText before textstream.py: the whole output decoded and
    searched after every step."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _stop_at(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _advance(self, text: str, end: int) -> str:
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text, cut)
        settled = text.rstrip("\ufffd")
        return self._advance(text, len(settled) - self._held_back(settled))

    def finish(self) -> str:
        text = self._decode()
        cut = self._stop_at(text)
        final = text if cut is None else text[:cut]
        return self._advance(final, len(final))


# -- the three paths: each returns (tokens, CPU seconds spent on text) -------------------------


class TimedTextStream(TextStream):
    """The new path's TextStream, adding up the CPU time of its calls."""

    spent = 0.0

    def _timed(self, call: Callable[..., Any], *args: Any) -> Any:
        start = time.process_time()
        try:
            return call(*args)
        finally:
            TimedTextStream.spent += time.process_time() - start

    def feed(self, committed: Sequence[int]) -> list[int]:
        return self._timed(super().feed, committed)

    def take(self) -> str:
        return self._timed(super().take)

    def finish(self) -> str:
        return self._timed(super().finish)


def run_model(engine: SpeculativeDecoder, ids: list[int], n: int, stop: str) -> tuple[int, float]:
    request = GenerationRequest(n, SamplingParams(), eos_token_ids=())
    return sum(len(chunk) for chunk in engine.stream_request(ids, request)), 0.0


def run_old(engine: SpeculativeDecoder, ids: list[int], n: int, stop: str) -> tuple[int, float]:
    request = GenerationRequest(n, SamplingParams(), eos_token_ids=())  # stops checked below
    stop_check = OldStopStrings(engine.tokenizer, [stop])
    text = OldIncrementalText(engine.tokenizer, [stop])
    produced, spent = 0, 0.0
    chunks = engine.stream_request(ids, request)
    for committed in chunks:
        start = time.process_time()
        kept = stop_check.feed(committed)  # the engine's check, after each step
        text.push(committed if kept is None else kept)  # the server's stream
        spent += time.process_time() - start
        produced += len(committed if kept is None else kept)
        if kept is not None:
            break
    chunks.close()
    start = time.process_time()
    text.finish()
    return produced, spent + time.process_time() - start


def run_new(engine: SpeculativeDecoder, ids: list[int], n: int, stop: str) -> tuple[int, float]:
    TimedTextStream.spent = 0.0
    engine.text_stream = lambda request: TimedTextStream(engine.tokenizer, request.stops)
    worker = GenerationWorker(engine, queue_size=1)  # its loop, called here on this thread
    params = GenerationParams(
        prompt=ids,
        chat=False,
        max_tokens=n,
        temperature=0.0,
        top_p=None,
        top_k=None,
        seed=0,
        stops=[stop],
    )
    events: list[Any] = []
    worker._run(Job(params, "/v1/completions", events.append))
    if not isinstance(events[-1], Finished):
        raise SystemExit(f"the worker failed: {events[-1]}")
    return len(events[-1].outcome.token_ids), TimedTextStream.spent


PATHS: dict[str, Callable[[SpeculativeDecoder, list[int], int, str], tuple[int, float]]] = {
    "model": run_model,
    "old": run_old,
    "new": run_new,
}


def cpu_seconds(run: Callable[[], tuple[int, float]], repeats: int) -> tuple[float, float, int]:
    """The least process CPU time of `repeats` runs, in all and on text, and the tokens."""
    total, text, tokens = float("inf"), float("inf"), 0
    for _ in range(repeats):
        start = time.process_time()
        tokens, spent = run()
        total, text = min(total, time.process_time() - start), min(text, spent)
    return total, text, tokens


def build_engine(longest: int) -> SpeculativeDecoder:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdecode.models.fetch import fetch_preset

    tokenizer = AutoTokenizer.from_pretrained(fetch_preset(PRESET))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=longest + 256,
        eos_token_id=None,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).eval()
    engine = SpeculativeDecoder(wrap_model(model, tokenizer, name="tiny-random"))
    engine.eos_token_ids = set()  # every generation runs to its length
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths",
        default="100,500,1000,2000,4000",
        help="generated tokens, comma-separated (default 100,500,1000,2000,4000)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per path, the best kept")
    parser.add_argument("--stop", default=NEVER, help="the stop string (it should never appear)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(1)
    engine = build_engine(max(lengths))
    ids = engine.encode_prompt(PROMPT)
    print(f"{PRESET}'s tokenizer, a random 1-layer model, greedy, one token per step\n")
    print(
        "| tokens | model ms/token | old: text µs/token | new: text µs/token | old / new "
        "| old: total ms/token | new: total ms/token |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for path in PATHS.values():  # warm-up: first calls pay one-off costs
            path(engine, ids, 16, args.stop)
        for n in lengths:
            total: dict[str, float] = {}
            text: dict[str, float] = {}
            for name, path in PATHS.items():
                total[name], text[name], tokens = cpu_seconds(
                    lambda p=path, n=n: p(engine, ids, n, args.stop), args.repeats
                )
                if tokens != n:
                    raise SystemExit(f"{name}: {tokens} tokens instead of {n} (did --stop appear?)")
            ratio = f"{text['old'] / text['new']:.1f}" if text["new"] > 0 else "-"
            print(
                f"| {n} | {total['model'] / n * 1e3:.2f} | {text['old'] / n * 1e6:.0f} "
                f"| {text['new'] / n * 1e6:.0f} | {ratio} | {total['old'] / n * 1e3:.2f} "
                f"| {total['new'] / n * 1e3:.2f} |"
            )


if __name__ == "__main__":
    main()
