"""The order `run-batch` takes its requests in (server/batch_order.py): each row that ends is
handed the waiting request sharing the longest prompt prefix with it, and the answers stay the
server's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode import SpeculativeDecoder
from specdecode.models.loading import wrap_model
from specdecode.server.app import create_app
from specdecode.server.batch_file import BatchRequest, parse_line, read_requests
from specdecode.server.batch_order import PrefixOrder, key_of, prompt_key, shared
from specdecode.server.run_batch import run_batch
from test_run_batch import MODEL, TEMPLATE, read_jsonl, stable, write_jsonl

from conftest import WIDE, char_tokenizer, needs_kernel, on_kernel, tiny_llama

# few distinct ids, so that prompts share prefixes; ids apart in one byte or in several
ids = st.lists(st.sampled_from([0, 1, 255, 256, 65_537, 151_935]), max_size=6)
keys = st.lists(ids.map(key_of), min_size=1, max_size=30)


def order_of(prompts: list[bytes]) -> PrefixOrder:
    requests = [BatchRequest(i + 1, f"r{i}") for i in range(len(prompts))]
    return PrefixOrder(requests, list(prompts))


@given(ids, ids)
def test_keys_order_and_share_as_the_ids_do(a, b):
    assert (key_of(a) < key_of(b)) == (a < b)
    pairs = enumerate(zip(a, b, strict=False))
    same = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
    assert shared(key_of(a), key_of(b)) == same


@settings(max_examples=200, deadline=None)
@given(keys, st.integers(1, 5), st.data())
def test_each_end_is_followed_by_the_longest_shared_prompt(prompts, workers, data):
    order = order_of(prompts)
    left = dict(enumerate(prompts))
    running = order.first(workers)
    assert len(running) == min(workers, len(prompts))
    taken = [request.custom_id for request, _ in running]
    for request, _ in running:
        del left[int(request.custom_id[1:])]
    while running:  # any of those running may end next
        request, key = running.pop(data.draw(st.integers(0, len(running) - 1)))
        best = max((shared(key, other) for other in left.values()), default=None)
        following = order.after(key)
        if best is None:
            assert following is None
            continue
        assert following is not None
        request, next_key = following
        assert next_key == prompts[int(request.custom_id[1:])]
        assert shared(key, next_key) == best
        del left[int(request.custom_id[1:])]
        taken.append(request.custom_id)
        running.append(following)
    assert sorted(taken) == sorted(f"r{i}" for i in range(len(prompts)))  # each once
    assert len(order) == 0


def test_the_first_rows_are_spread_over_the_prompts():
    prompts = [key_of([1, 1])] * 4 + [key_of([2, 2])] * 4 + [key_of([3, 3])] * 4
    firsts = [key for _, key in order_of(prompts).first(3)]
    assert firsts == [key_of([1, 1]), key_of([2, 2]), key_of([3, 3])]


def test_a_prompt_is_keyed_by_the_ids_the_server_prefills():
    tokenizer = char_tokenizer(":")
    tokenizer.chat_template = TEMPLATE
    engine = SpeculativeDecoder(wrap_model(tiny_llama(vocab=len(tokenizer)), tokenizer), None)
    chat = parse_line(1, json.dumps({"messages": [{"role": "user", "content": "hi"}]}), MODEL)
    typed = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    as_parts = parse_line(2, json.dumps(typed), MODEL)
    text = parse_line(3, json.dumps({"prompt": "hi"}), MODEL)
    assert prompt_key(engine.encode_prompt, chat) == key_of(
        engine.encode_prompt([{"role": "user", "content": "hi"}], True)
    )
    assert prompt_key(engine.encode_prompt, as_parts) == prompt_key(engine.encode_prompt, chat)
    assert prompt_key(engine.encode_prompt, text) == key_of(engine.encode_prompt("hi"))
    refused = [
        parse_line(4, "{not json", MODEL),
        parse_line(5, json.dumps({"messages": []}), MODEL),
        parse_line(6, json.dumps({"prompt": ""}), MODEL),
    ]
    assert [prompt_key(engine.encode_prompt, r) for r in refused] == [b"", b"", b""]


@needs_kernel()
def test_repeated_prompts_keep_their_prefill_and_answer_as_the_server(tmp_path):
    # a prefix is kept on the kernels' fused path (docs/architecture.md, "Prefix reuse")
    tokenizer = char_tokenizer(":")
    target = on_kernel(tiny_llama(seed=0, vocab=len(tokenizer), **WIDE), bits=4)
    target = wrap_model(target, tokenizer, name=MODEL)

    def engine() -> SpeculativeDecoder:
        return SpeculativeDecoder(target, None)

    # four prompts, each three times, interleaved: in the input's order a repeat never meets the
    # row its prompt left; taken by shared prefix, nearly every repeat keeps the whole prompt
    texts = ["the sea is blue and deep", "a cat sat on the mat", "one two three four", "stars"]
    lines = [
        {"custom_id": f"r{i}", "prompt": texts[i % 4], "max_tokens": 6 + i % 3, "temperature": 0}
        for i in range(12)
    ]
    write_jsonl(tmp_path / "in.jsonl", lines)
    summary = run_batch(engine(), tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                        model_name=MODEL, max_batch=2, progress=False)  # fmt: skip
    assert summary.complete and summary.answered == 12
    out = read_jsonl(tmp_path / "out.jsonl")
    usage = [record["response"]["body"]["usage"] for record in out]
    kept = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    whole = [k == u["prompt_tokens"] - 1 for k, u in zip(kept, usage, strict=True)]
    assert sum(whole) >= 12 - 4 - 2  # all but each prompt's first and (at most) the two rows'
    with TestClient(create_app(engine(), MODEL)) as client:
        for request, record in zip(read_requests(tmp_path / "in.jsonl", MODEL), out, strict=True):
            alone = client.post(request.url, json=request.body).json()
            answer = stable(record["response"]["body"])
            assert answer["choices"] == stable(alone)["choices"], request.custom_id
