"""`specdecode serve`: the real uvicorn server on 127.0.0.1, driven by the openai client and httpx.

Tiny float32 models (a Llama target, a noisy copy as draft) with a character tokenizer: greedy
outputs through the API must equal the engine's own `generate`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specdecode import SpeculativeDecoder  # noqa: E402
from specdecode.cli import main  # noqa: E402
from specdecode.models.loading import wrap_model  # noqa: E402
from specdecode.runtime.textstream import TextStream  # noqa: E402
from specdecode.server.app import create_app  # noqa: E402
from specdecode.server.background import serve_in_thread  # noqa: E402

from conftest import char_tokenizer, noisy_copy, tiny_llama  # noqa: E402

MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CONTEXT = 256  # the tiny models' max_position_embeddings
MAX_PROMPT_TOKENS = 100


# -- fixtures: models, engines, a server in a thread ------------------------------------------


def tiny_models():
    """(target, draft): a tiny Llama with a chat-template character tokenizer, a noisy copy."""
    tokenizer = char_tokenizer(":")
    tokenizer.chat_template = CHAT_TEMPLATE
    target = tiny_llama(seed=0, vocab=len(tokenizer))
    return wrap_model(target, tokenizer, name=MODEL), noisy_copy(target, 0.05)


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def make_engine(models, cls=SpeculativeDecoder) -> SpeculativeDecoder:
    """A fresh engine (its own drafter cache) over the shared, stateless tiny models."""
    target, draft = models
    return cls(target, draft, k=3, k_policy="fixed")


@pytest.fixture(scope="module")
def reference(models) -> SpeculativeDecoder:
    """The engine the API's outputs are checked against; used only from the test thread."""
    return make_engine(models)


@contextlib.contextmanager
def serving(engine: SpeculativeDecoder, **options) -> Iterator[str]:
    """The app over `engine` under uvicorn on a free port, in a thread; yields its base URL."""
    with serve_in_thread(create_app(engine, MODEL, **options)) as base:
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        yield base


@pytest.fixture(scope="module")
def url(models) -> Iterator[str]:
    with serving(make_engine(models), max_prompt_tokens=MAX_PROMPT_TOKENS) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def metric_values(text: str, model: str = MODEL) -> dict[str, float]:
    """Prometheus text, read by prometheus_client's own parser -> {'name{labels}': value}.

    Every sample must carry model_name=`model`; the keys leave it out and list the other labels
    in name order: 'specdecode_requests_total{endpoint="/v1/models",status="200"}'.
    """
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None) == model, sample
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            values[sample.name + (f"{{{inner}}}" if inner else "")] = sample.value
    return values


def sse_events(response) -> list[dict | str]:
    """The data of each server-sent event ('[DONE]' kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- the OpenAI client: same output as the engine, streamed or not ------------------------------


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["queue_depth"] == 0


def test_completions_match_engine(client, reference):
    expected = reference.generate("the cat", max_new_tokens=24, temperature=0.0)
    stats = expected.stats
    args = dict(model=MODEL, prompt="the cat", max_tokens=24, temperature=0)
    out = client.completions.create(**args)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == ("length" if stats.stop_reason == "length" else "stop")
    usage = out.usage
    assert usage.prompt_tokens == len(expected.prompt_ids)
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == stats.accepted
    assert details.rejected_prediction_tokens == stats.drafted - stats.accepted
    spec = usage.model_extra["speculative"]
    assert spec["steps"] == stats.steps and spec["drafted"] == stats.drafted > 0
    assert spec["accepted"] == stats.accepted
    assert spec["acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    assert spec["mean_acceptance_length"] == pytest.approx(stats.mean_acceptance_length)

    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage (OpenAI)

    by_ids = client.completions.create(**{**args, "prompt": expected.prompt_ids})
    assert by_ids.choices[0].text == expected.text


def test_chat_matches_engine(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    expected = reference.generate(messages, max_new_tokens=30, temperature=0.0, chat=True)
    args = dict(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    out = client.chat.completions.create(**args)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(expected.prompt_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)

    stream = client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text == out.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == out.choices[0].finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # include_usage: last chunk
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.model_extra["speculative"] == out.usage.model_extra["speculative"]

    # max_completion_tokens is OpenAI's newer name for max_tokens
    newer = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=30, temperature=0
    )
    assert newer.choices[0].message.content == expected.text


def test_stop_strings_streamed_and_not(client, reference):
    full = reference.generate("hello", max_new_tokens=40, temperature=0.0).text
    stop = full[4:6]  # a stop string the greedy output reaches
    expected = reference.generate("hello", max_new_tokens=40, temperature=0.0, stop=stop)
    assert expected.text == full[: full.find(stop)]
    args = dict(model=MODEL, prompt="hello", max_tokens=40, temperature=0, stop=[stop, "!!!"])
    out = client.completions.create(**args)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def _target_logprobs(reference, prompt_ids: list[int], token_ids: list[int]):
    """The target's own log-softmax before each generated token: one forward over the prompt
    and the output -> [n, V]."""
    import torch

    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = reference.target.model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)


def test_completion_logprobs_are_the_targets_own(client, reference):
    expected = reference.generate("the cat", max_new_tokens=24, temperature=0.0)
    eos = set(reference.eos_token_ids or ())
    ids = [t for t in expected.token_ids if t not in eos]
    target = _target_logprobs(reference, expected.prompt_ids, expected.token_ids)
    args = dict(model=MODEL, prompt="the cat", max_tokens=24, temperature=0, logprobs=3)
    out = client.completions.create(**args)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text == expected.text
    assert len(lp.token_logprobs) == len(ids)
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert value == pytest.approx(float(target[i, ids[i]]), abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(value)  # greedy: the likeliest
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for part in streamed for t in part.tokens] == lp.tokens
    assert [v for part in streamed for v in part.token_logprobs] == lp.token_logprobs
    assert [o for part in streamed for o in part.text_offset] == lp.text_offset
    plain = client.completions.create(**{**args, "logprobs": None})
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_streamed_and_not_and_cut_by_a_stop_string(client, reference):
    args = dict(model=MODEL, messages=HI, max_tokens=20, temperature=0, logprobs=True)
    out = client.chat.completions.create(**args, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and c.bytes == list(c.token.encode("utf-8"))
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy: the likeliest
    chunks = list(client.chat.completions.create(**args, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    no_top = client.chat.completions.create(**args).choices[0].logprobs.content
    assert [(e.token, e.logprob, e.top_logprobs) for e in no_top] == [(e.token, e.logprob, []) for e in content]  # fmt: skip
    text = out.choices[0].message.content
    stop = text[3:5]  # a stop string the greedy output reaches: only the tokens before it
    cut = client.chat.completions.create(**args, stop=[stop])
    assert "".join(c.token for c in cut.choices[0].logprobs.content) == text[: text.find(stop)]
    # streamed with the stop string: each chunk's entries are its text's tokens (one character
    # each here), the held-back text's with it, the stop string's never
    chunks = list(client.chat.completions.create(**args, stop=[stop], stream=True))
    parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    for part in parts:
        assert "".join(e.token for e in part.logprobs.content) == part.delta.content
    assert "".join(p.delta.content for p in parts) == text[: text.find(stop)]
    assert client.chat.completions.create(**{**args, "logprobs": False}).choices[0].logprobs is None


def test_sampling_is_seeded(client):
    args = dict(model=MODEL, prompt="abc", max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first
    extra = client.completions.create(**args, extra_body={"top_k": 5}).choices[0].text
    assert isinstance(extra, str)


# -- bad input: 4xx in OpenAI's shape, and the server keeps serving ----------------------------

LONG = "ab" * 60  # 120 tokens > MAX_PROMPT_TOKENS
C, CH = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}
HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (path, body: bytes = raw, dict = merged into GOOD / a chat body, status, param)
    (C, b"{not json", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"\xff\xfe", 400, None),
    (C, b"", 400, None),
    (C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (C, {"max_tokens": "5"}, 400, "max_tokens"),
    (C, {"max_tokens": 4.5}, 400, "max_tokens"),
    (C, {"temperature": "hot"}, 400, "temperature"),
    (C, {"stream": "yes"}, 400, "stream"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": None}, 400, "prompt"),
    (C, {"model": None}, 400, "model"),
    (C, {"seed": True}, 400, "seed"),
    (C, {"seed": 2**70}, 400, "seed"),
    (C, {"temperature": -0.1}, 400, "temperature"),
    (C, {"temperature": 2.5}, 400, "temperature"),
    (C, {"top_p": 0}, 400, "top_p"),
    (C, {"top_p": 1.5}, 400, "top_p"),
    (C, {"top_k": 0}, 400, "top_k"),
    (C, {"max_tokens": 0}, 400, "max_tokens"),
    (C, {"max_tokens": CONTEXT}, 400, "max_tokens"),  # prompt + max_tokens > context
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": LONG}, 400, "prompt"),  # > --max-prompt-tokens
    (C, {"prompt": [1, 2, 10_000]}, 400, "prompt"),  # outside the vocabulary
    (C, {"prompt": ["a", "b"]}, 400, "prompt"),  # a batch
    (C, {"stop": ""}, 400, "stop"),
    (C, {"stop": ["a", 3]}, 400, "stop"),
    (C, {"n": 2}, 400, "n"),
    (C, {"best_of": 3}, 400, "best_of"),
    (C, {"logprobs": 6}, 400, "logprobs"),  # OpenAI's most: 5
    (C, {"logprobs": True}, 400, "logprobs"),  # strict: an integer
    (C, {"echo": True}, 400, "echo"),
    (C, {"suffix": "x"}, 400, "suffix"),
    (C, {"presence_penalty": 0.5}, 400, "presence_penalty"),
    (C, {"logit_bias": {"3": 10}}, 400, "logit_bias"),
    (C, {"model": "gpt-4"}, 404, "model"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": "hi"}, 400, "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CH, {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),  # empty prompt
    (CH, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CH, {"logprobs": 1}, 400, "logprobs"),  # strict: a boolean
    (CH, {"top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
    (CH, {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),  # OpenAI's most: 20
    (CH, {"tools": [{"type": "function"}]}, 400, "tools"),
    (CH, {"response_format": {"type": "json_object"}}, 400, "response_format"),
    (CH, {"model": "other"}, 404, "model"),
]


def _bad_request(url: str, path: str, body, client: httpx.Client):
    if isinstance(body, bytes):
        return client.post(url + path, content=body, headers={"Content-Type": "application/json"})
    base = dict(GOOD)
    if path == CH:
        base = {"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0}
    return client.post(url + path, json={**base, **body})


def test_bad_input_gets_4xx_in_openai_shape(url):
    with httpx.Client(timeout=30) as http:
        for path, body, status, param in BAD_REQUESTS:
            for stream in (False, True):
                if stream and isinstance(body, bytes):
                    continue
                sent = {**body, "stream": True} if stream and "stream" not in body else body
                response = _bad_request(url, path, sent, http)
                case = f"{path} {body!r} stream={stream}"
                assert response.status_code == status, f"{case}: {response.text}"
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, case
                assert error["message"] and error["type"], case
                assert error["param"] == param, f"{case}: {error}"
        assert http.get(url + "/v1/nowhere").status_code == 404
        assert http.get(url + C).status_code == 405
        assert "error" in http.get(url + C).json()
        # unknown parameters are ignored, as OpenAI clients expect; the server still serves
        ok = http.post(url + C, json={**GOOD, "user": "u", "frobnicate": [1], "n": 1})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] is not None
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        }
        assert http.post(url + CH, json={**chat, "max_tokens": 3}).status_code == 200


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, n=2)


# -- load: bounded queue, 429 + Retry-After, nothing lost ----------------------------------


def _completion_text(http: httpx.Client, url: str, prompt: str, stream: bool) -> tuple[str, int]:
    """(text, number of 429 answers before it succeeded)."""
    busy = 0
    body = {**GOOD, "prompt": prompt, "max_tokens": 5, "stream": stream}
    while True:
        if stream:
            with http.stream("POST", url + C, json=body) as response:
                if response.status_code == 200:
                    events = sse_events(response)
                    assert events[-1] == "[DONE]"
                    return "".join(e["choices"][0]["text"] for e in events[:-1]), busy
                response.read()
        else:
            response = http.post(url + C, json=body)
            if response.status_code == 200:
                return response.json()["choices"][0]["text"], busy
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
        busy += 1
        time.sleep(0.02)  # shorter than Retry-After: keeps the test fast


def test_load_with_a_bounded_queue(models, reference):
    prompts = ["hello", "the cat", "abc", "once upon", "zz top", "a, b.", "why?", "ok ok"]
    expected = {p: reference.generate(p, max_new_tokens=5, temperature=0.0).text for p in prompts}
    n_requests, n_clients = 200, 16
    with serving(make_engine(models), queue_size=2) as base:
        local = threading.local()

        def one(i: int) -> tuple[str, str, int]:
            if not hasattr(local, "http"):
                local.http = httpx.Client(timeout=60)
            prompt = prompts[i % len(prompts)]
            text, busy = _completion_text(local.http, base, prompt, stream=i % 4 == 0)
            return prompt, text, busy

        with ThreadPoolExecutor(n_clients) as pool:
            results = list(pool.map(one, range(n_requests)))
        values = metric_values(httpx.get(base + "/metrics").text)

    assert len(results) == n_requests
    assert all(text == expected[prompt] for prompt, text, _ in results)
    busy = sum(b for _, _, b in results)
    assert busy > 0, "the queue limit was never reached"
    assert values['specdecode_requests_total{endpoint="/v1/completions",status="429"}'] == busy
    assert values['specdecode_requests_total{endpoint="/v1/completions",status="200"}'] == 200
    assert values["vllm:num_requests_waiting"] == 0


def test_a_failing_draft_prefill_fails_its_request_only(models, reference):
    """The draft's prefill runs after the first token went out: should it fail, that request
    ends with a 500 (its stream with OpenAI's error event), the rows beside it go on."""
    engine = make_engine(models)
    base_class = type(engine.drafter)

    class LongPromptsFail(base_class):
        def begin(self, prompt_ids, *args, **kwargs):
            if len(prompt_ids) > 30:
                raise RuntimeError("the draft's prefill failed")
            return super().begin(prompt_ids, *args, **kwargs)

    engine.drafter.__class__ = LongPromptsFail  # every row's fork of it too
    long_prompt = "the cat sat on the mat, the dog sat too."  # 40 tokens; no EOS first
    args = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    expected = reference.generate("the cat", max_new_tokens=12, temperature=0.0).text
    with serving(engine) as base, httpx.Client(timeout=60) as http:

        def post(prompt: str) -> httpx.Response:
            return http.post(base + C, json={**args, "prompt": prompt})

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(post, [long_prompt, "the cat", long_prompt, "the cat"]))
        for failed in answers[::2]:
            assert failed.status_code == 500
            assert failed.json()["error"]["type"] == "server_error"
        assert all(ok.json()["choices"][0]["text"] == expected for ok in answers[1::2])
        with http.stream(
            "POST", base + C, json={**args, "prompt": long_prompt, "stream": True}
        ) as r:
            assert r.status_code == 200  # the first token was out before the draft's prefill
            events = sse_events(r)
        assert events[-1]["error"]["type"] == "server_error"
        values = metric_values(http.get(base + "/metrics").text)
    errors = 'specdecode_generations_total{endpoint="/v1/completions",outcome="error"}'
    assert values[errors] == 3
    assert values["vllm:num_requests_running"] == 0


# -- disconnects and timeouts -----------------------------------------------------------------


class SlowEngine(SpeculativeDecoder):
    """The engine with a pause after each step, so a request is surely still running when the
    test acts; EOS is ignored so that generation runs to max_tokens."""

    delay_s = 0.03

    # the worker steps a batch session: each step waits first
    def batch_session(self, *args, **kwargs):
        session = super().batch_session(*args, **kwargs)
        step = session.step

        def slowly():
            time.sleep(self.delay_s)
            return step()

        session.step = slowly
        return session


def _slow_engine(models) -> SlowEngine:
    engine = make_engine(models, SlowEngine)
    engine.eos_token_ids = set()
    return engine


def _wait_for(url: str, key: str, value: float, timeout_s: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = metric_values(httpx.get(url + "/metrics").text)
        if values.get(key) == value or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_disconnect_stops_generation(models):
    long = {**GOOD, "max_tokens": 200}
    cancelled = 'specdecode_generations_total{endpoint="/v1/completions",outcome="cancelled"}'
    with serving(_slow_engine(models), queue_size=1) as base, httpx.Client(timeout=30) as http:
        with http.stream("POST", base + C, json={**long, "stream": True}) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("data: ")
        # the stream was closed after one event: generation stops at the next step
        values = _wait_for(base, cancelled, 1)
        assert values[cancelled] == 1
        assert values["vllm:generation_tokens_total"] < 200

        # a non-streaming client that gives up: its generation stops too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + C, json=long, timeout=0.3)
        values = _wait_for(base, cancelled, 2)
        assert values[cancelled] == 2
        assert values["vllm:generation_tokens_total"] < 400

        # a client that gives up while queued frees its place at once
        with http.stream("POST", base + C, json={**long, "stream": True}) as running:
            assert running.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + C, json=long, timeout=0.3)
            values = _wait_for(base, cancelled, 3)
            assert values["vllm:num_requests_waiting"] == 0
            assert values["vllm:num_requests_running"] == 1  # the stream still generates
        values = _wait_for(base, cancelled, 4)
        assert values[cancelled] == 4
        running = "vllm:num_requests_running"
        assert _wait_for(base, running, 0)[running] == 0

        # and the server serves the next request
        ok = http.post(base + C, json={**GOOD, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_timeout(models):
    long = {**GOOD, "max_tokens": 200}
    with serving(_slow_engine(models), timeout_s=0.3) as base, httpx.Client(timeout=30) as http:
        response = http.post(base + C, json=long)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "timeout"
        # a stream that times out ends with finish_reason "abort" (vLLM's, not "length": it did
        # not reach max_tokens) and an error event that says why, then [DONE]
        with http.stream("POST", base + C, json={**long, "stream": True}) as streamed:
            assert streamed.status_code == 200
            events = sse_events(streamed)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "timeout"
        assert events[-3]["choices"][0]["finish_reason"] == "abort"
        timeouts = 'specdecode_generations_total{endpoint="/v1/completions",outcome="timeout"}'
        values = metric_values(http.get(base + "/metrics").text)
        assert values[timeouts] == 2
        assert values["vllm:generation_tokens_total"] < 400
        ok = http.post(base + C, json={**GOOD, "max_tokens": 2})
        assert ok.status_code == 200

        # a request whose time runs out while it waits in the queue: 504 too
        with http.stream("POST", base + C, json={**long, "stream": True}) as running:
            assert running.status_code == 200
            queued = httpx.post(base + C, json=long, timeout=30)
        assert queued.status_code == 504


# -- /metrics adds up to what was sent ---------------------------------------------------------


REASONS = ("stop", "length", "abort")


def test_metrics_add_up(models):
    usages = []
    with serving(make_engine(models)) as base, httpx.Client(timeout=30) as http:
        for prompt in ("hello", "the cat"):
            out = http.post(base + C, json={**GOOD, "prompt": prompt, "max_tokens": 12})
            usages.append(out.json()["usage"])
        stream_body = {**GOOD, "max_tokens": 9, "stream": True}
        stream_body["stream_options"] = {"include_usage": True}
        with http.stream("POST", base + C, json=stream_body) as response:
            usages.append(sse_events(response)[-2]["usage"])
        for content in ("hi", "abc"):
            chat = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            out = http.post(base + CH, json={**chat, "max_tokens": 7, "temperature": 0})
            usages.append(out.json()["usage"])
        assert http.post(base + C, json={**GOOD, "top_p": 2}).status_code == 400
        too_long = http.post(base + C, json={**GOOD, "prompt": "a" * (CONTEXT + 1)})
        assert too_long.status_code == 400  # beyond the context (no --max-prompt-tokens here)
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        unknown = {"model": "x", "messages": HI}
        assert http.post(base + CH, json=unknown).status_code == 404
        assert http.get(base + "/v1/models").status_code == 200
        values = metric_values(http.get(base + "/metrics").text)

    def requests(endpoint: str, status: int) -> float:
        return values.get(
            f'specdecode_requests_total{{endpoint="{endpoint}",status="{status}"}}', 0
        )

    assert requests(C, 200) == 3 and requests(C, 400) == 2
    assert requests(CH, 200) == 2 and requests(CH, 404) == 1
    assert requests("/v1/models", 200) == 1
    assert requests("/health", 200) >= 1  # the start-up probe
    outcome = 'specdecode_generations_total{{endpoint="{}",outcome="{}"}}'
    generations = {k: v for k, v in values.items() if k.startswith("specdecode_generations_total")}
    assert sum(generations.values()) == 5
    assert (
        values.get(outcome.format(C, "length"), 0) + values.get(outcome.format(C, "stop"), 0) == 3
    )

    assert (
        values.get(outcome.format(CH, "length"), 0) + values.get(outcome.format(CH, "stop"), 0) == 2
    )
    success = {r: values[f'vllm:request_success_total{{finished_reason="{r}"}}'] for r in REASONS}
    assert success["stop"] + success["length"] == 5 and success["abort"] == 0

    total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens")}
    assert values["vllm:prompt_tokens_total"] == total["prompt_tokens"]
    assert values["vllm:generation_tokens_total"] == total["completion_tokens"]
    steps = sum(u["speculative"]["steps"] for u in usages)
    assert values["specdecode_speculative_steps_total"] == steps
    # one k per batched step, never above the engine's fixed k = 3
    batched = values["specdecode_batch_size_count"]
    assert batched >= 1 and values["specdecode_step_k_count"] == batched
    assert values['specdecode_step_k_bucket{le="3.0"}'] == batched
    assert 0 < values["specdecode_step_k_sum"] <= 3 * batched
    drafted = sum(u["speculative"]["drafted"] for u in usages)
    assert values["vllm:spec_decode_num_draft_tokens_total"] == drafted
    accepted = sum(u["speculative"]["accepted"] for u in usages)
    assert accepted == sum(
        u["completion_tokens_details"]["accepted_prediction_tokens"] for u in usages
    )
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == accepted
    # per position (0 = the first drafted token, as vLLM): the positions add up to the totals,
    # and acceptance only falls with depth
    drafted_at = [
        values[f'specdecode_spec_decode_num_draft_tokens_per_pos_total{{position="{i}"}}']
        for i in (0, 1, 2)
    ]
    accepted_at = [
        values[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
        for i in (0, 1, 2)
    ]
    assert sum(drafted_at) == drafted
    assert sum(accepted_at) == accepted
    assert accepted_at == sorted(accepted_at, reverse=True)
    assert values["vllm:spec_decode_num_drafts_total"] == drafted_at[0] == steps  # fixed k = 3
    # every generation once in each histogram, the token ones adding up to the usage
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert values[f"vllm:{hist}_count"] == 5
        assert values[f'vllm:{hist}_bucket{{le="+Inf"}}'] == 5
    assert values["vllm:request_queue_time_seconds_count"] == 5
    # queue + prefill = time to first token; that + decode = the whole request
    for phase in ("prefill", "decode"):
        assert values[f"vllm:request_{phase}_time_seconds_count"] == 5
    queue, prefill, decode = (
        values[f"vllm:request_{phase}_time_seconds_sum"] for phase in ("queue", "prefill", "decode")
    )
    assert queue + prefill == pytest.approx(values["vllm:time_to_first_token_seconds_sum"])
    assert queue + prefill + decode == pytest.approx(values["vllm:e2e_request_latency_seconds_sum"])
    assert values["vllm:request_prompt_tokens_sum"] == total["prompt_tokens"]
    assert values["vllm:request_generation_tokens_sum"] == total["completion_tokens"]
    assert values["vllm:request_generation_tokens_count"] == 5
    assert values["vllm:num_requests_waiting"] == 0


# -- units: incremental text, Prometheus format, the command line -------------------------------


class ByteTokenizer:
    """Each id is one UTF-8 byte: a multi-byte character spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def push_bytes(text: TextStream, data: bytes) -> list[str]:
    """Feed one byte per step, as the engine does, and take the text as the worker does."""
    deltas = []
    for b in data:
        if text.stopped:
            break
        text.feed([b])
        deltas.append(text.take())
    return deltas


def test_incremental_text_holds_back_partial_characters_and_stops():
    data = "héllo wörld".encode()
    text = TextStream(ByteTokenizer())
    deltas = push_bytes(text, data)
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + text.finish() == "héllo wörld"
    assert deltas[1] == "" and deltas[2] == "é"  # é is two bytes: sent once complete

    text = TextStream(ByteTokenizer(), stops=["lo w", "xyz"])
    deltas = push_bytes(text, data)
    sent = "".join(deltas)
    assert sent == "hél" and text.stopped
    assert text.final_text == "hél" and text.finish() == ""

    text = TextStream(ByteTokenizer(), stops=["ld!"])
    deltas = push_bytes(text, data)
    assert "".join(deltas) == "héllo wör"  # "l" and "ld" might begin the stop string
    assert text.finish() == "ld" and text.final_text == "héllo wörld"


def test_metrics_registry_per_app_and_odd_model_names(models):
    """Two apps in one process keep separate counters (no global registry); a model name with
    quotes, backslashes and a newline is escaped so that the parser reads it back."""
    odd = 'my "model"\\v1\n'
    first = create_app(make_engine(models), odd)
    second = create_app(make_engine(models), MODEL)
    first.state.server.metrics.count_request("/health", 200)
    text = first.state.server.metrics.render().decode()
    values = metric_values(text, model=odd)
    assert values['specdecode_requests_total{endpoint="/health",status="200"}'] == 1
    assert values["vllm:num_requests_running"] == 0
    assert (
        metric_values(second.state.server.metrics.render().decode()).get(
            'specdecode_requests_total{endpoint="/health",status="200"}'
        )
        is None
    )


def test_serve_without_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi -> ImportError
    assert main(["serve", "--target", "anything"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'specdecode[serve]'" in err


def test_serve_checks_numbers_before_loading(capsys):
    assert main(["serve", "--target", "anything", "--queue-size", "-1"]) == 2
    assert "queue-size" in capsys.readouterr().err


def test_a_tree_requests_usage_and_metrics_count_its_nodes():
    from specdecode.core.types import Stats
    from specdecode.server.responses import usage
    from specdecode.server.telemetry import ServerMetrics

    # two tree steps of depth 3 over 5 nodes each, 2 + 1 accepted
    stats = Stats(steps=2, drafted=6, accepted=3, nodes_verified=10, new_tokens=5)
    details = usage(stats)["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 7}
    chain = Stats(steps=2, drafted=6, accepted=3, new_tokens=5)  # no nodes: a chain
    assert usage(chain)["completion_tokens_details"]["rejected_prediction_tokens"] == 3
    telemetry = ServerMetrics("m", queue_depth=lambda: 0.0, running=lambda: 0.0)
    telemetry.count_generation("chat", "stop", stats)
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(telemetry.render().decode())
        for sample in family.samples
    }
    assert samples["specdecode_tree_nodes_verified_total"] == 10
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == 6  # depths: α = 3 / 6


def test_a_suffix_draft_serves_its_pool_and_reports_it(models):
    from specdecode.drafters import SuffixDrafter

    target, _ = models
    alone = SpeculativeDecoder(target)
    # fixed: the tree sized from the prior costs, the same on any machine's timings
    engine = SpeculativeDecoder(target, SuffixDrafter(), k_policy="fixed")
    body = {**GOOD, "prompt": "hello", "max_tokens": 16, "temperature": 0}
    with serving(engine) as base, httpx.Client(timeout=30) as http:
        first = http.post(base + C, json=body).json()
        again = http.post(base + C, json=body).json()  # drafts from the first one's output
        metrics = metric_values(http.get(base + "/metrics").text)
    expected = alone.generate("hello", max_new_tokens=16, temperature=0).text
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == expected
    speculative = again["usage"]["speculative"]
    assert speculative["drafter"] == "tree" and speculative["tree"] == "suffix"
    assert again["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert metrics["specdecode_suffix_pool_tokens"] == 32  # both outputs
    assert metrics["specdecode_suffix_pool_bytes"] > 0
