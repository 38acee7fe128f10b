"""A chat's second turn past 512 tokens through a 1-row batch session as the server runs it
(its prefill in parts of 128, the draft's prefill left to its first drafting step): the prompt
positions kept and the second turn's time to its first token. Argument: a label to print.

    python lab/probes/long_chat_turns.py new
"""

import sys
import time

from specdecode import SpeculativeDecoder
from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams
from specdecode.data.suites import load_suite
from specdecode.models.loading import load_model

target = load_model("qwen2.5-coder-1.5b-instruct:int4")
draft = load_model("qwen2.5-coder-0.5b-instruct:int4")
engine = SpeculativeDecoder(target, draft, k=4, k_policy="cost")
docs = [p.turns[0] for p in load_suite(None, categories=["summarization", "extraction_rag"])]
first = [{"role": "user", "content": docs[0] + "\n\n" + docs[1] + "\n\n" + docs[2]}]
session = engine.batch_session(max_rows=1, max_len=2048)


def run(messages, tokens):
    request = GenerationRequest(tokens, SamplingParams(), chat=True)
    t0 = time.perf_counter()
    try:
        partial = session.open_prefill(messages, request, parts=128)
    except TypeError:  # the code before open_prefill took parts
        partial = session.open_prefill(messages, request)
    while partial.remaining > 0:
        session.advance_prefill(partial, 128)
    g = session.add(messages, request, prefilled=partial, begin_draft=False)  # as the server
    ttft = time.perf_counter() - t0
    while session.generations:
        session.step()
    return g, ttft


g1, t1 = run(first, 48)
answer = engine.tokenizer.decode(g1.token_ids, skip_special_tokens=True)
second = [
    *first,
    {"role": "assistant", "content": answer},
    {"role": "user", "content": "Now say it in one sentence."},
]
g2, t2 = run(second, 16)
print(
    f"{sys.argv[1]}: turn 1: {len(g1.prompt_ids)} prompt tokens, first token {t1:.2f} s; "
    f"turn 2: {len(g2.prompt_ids)} prompt tokens, {g2.stats.cached_tokens} kept, first token {t2:.2f} s; "
    f"turn 2 tokens: {g2.token_ids}",
    flush=True,
)
