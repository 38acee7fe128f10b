"""A chat's second turn past 512 tokens through a 1-row batch session as the server's worker
runs it (the prompt in parts of 128, the last one add's; the draft's parts after the first
token where the code has `draft_later`): each turn's time to its first token and whole time,
the second turn's prompt positions kept and its first step after the first token (where the
draft's own prefill of the prompt lands when the draft keeps nothing).
Arguments: a label to print, then `docs` (three of the suite's documents to summarize: the
policy then seldom drafts) or `code` (a module of this repository to edit, twice: an answer
that copies its context, where drafting pays).

    python lab/probes/long_chat_turns.py new code
"""

import hashlib
import os
import sys
import time
from pathlib import Path

from specdecode import SpeculativeDecoder
from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams
from specdecode.data.suites import load_suite
from specdecode.drafters.factory import resolve_draft
from specdecode.models.loading import load_model

target = load_model("qwen2.5-coder-1.5b-instruct:int4")
# $DRAFT: the draft spec (`qwen2.5-coder-0.5b-instruct:int4+suffix` for the hybrid)
draft = resolve_draft(os.environ.get("DRAFT", "qwen2.5-coder-0.5b-instruct:int4"), target)
engine = SpeculativeDecoder(target, draft, k=4, k_policy="cost")
if sys.argv[2:] == ["code"]:
    source = (Path(__file__).parents[2] / "src/specdecode/models/prefix_cache.py").read_text()
    ask = "Rewrite the class PrefixCache with a comment above each method. Show the code."
    first = [{"role": "user", "content": f"```python\n{source[:3000]}\n```\n\n{ask}"}]
    follow_up, new_tokens = "Now rename `budget` to `limit` everywhere. Show the code.", (96, 96)
else:
    docs = [p.turns[0] for p in load_suite(None, categories=["summarization", "extraction_rag"])]
    first = [{"role": "user", "content": docs[0] + "\n\n" + docs[1] + "\n\n" + docs[2]}]
    follow_up, new_tokens = "Now say it in one sentence.", (48, 64)
session = engine.batch_session(max_rows=1, max_len=2048)


def run(messages, tokens):
    request = GenerationRequest(tokens, SamplingParams(), chat=True)
    drafted = session.batch.meter.tokens.get("draft_prefill", 0)
    t0 = time.perf_counter()
    try:  # as the server's worker opens it
        partial = session.open_prefill(messages, request, parts=128, draft_later=True)
    except TypeError:  # the code before the draft's parts followed the first token
        partial = session.open_prefill(messages, request, parts=128)
    while partial.remaining > 128:  # as the server's worker: the last part is add's
        session.advance_prefill(partial, 128)
    g = session.add(messages, request, prefilled=partial, begin_draft=False)
    ttft = time.perf_counter() - t0
    session.step()  # the next tokens: where the draft's own prefill of the prompt lands
    second = time.perf_counter() - t0 - ttft
    while session.generations:
        session.step()
    drafted = session.batch.meter.tokens.get("draft_prefill", 0) - drafted
    return g, ttft, second, time.perf_counter() - t0, drafted


g1, t1, _, w1, d1 = run(first, new_tokens[0])
answer = engine.tokenizer.decode(g1.token_ids, skip_special_tokens=True)
second = [
    *first,
    {"role": "assistant", "content": answer},
    {"role": "user", "content": follow_up},
]
g2, t2, s2, w2, d2 = run(second, new_tokens[1])
print(
    f"{sys.argv[1]}: turn 1: {len(g1.prompt_ids)} prompt tokens, first token {t1:.2f} s, "
    f"the turn {w1:.2f} s ({len(g1.token_ids)} tokens), "
    f"draft prefill {d1}, drafted {g1.stats.drafted} / accepted {g1.stats.accepted}; "
    f"turn 2: {len(g2.prompt_ids)} prompt tokens, {g2.stats.cached_tokens} kept, "
    f"first token {t2:.2f} s, its first step {s2:.2f} s, the turn {w2:.2f} s "
    f"({len(g2.token_ids)} tokens), draft prefill {d2}, drafted {g2.stats.drafted} / "
    f"accepted {g2.stats.accepted}; turn 2 tokens: {g2.token_ids[:6]}..., "
    f"sha1 of all {hashlib.sha1(str(g2.token_ids).encode()).hexdigest()[:12]}",
    flush=True,
)
