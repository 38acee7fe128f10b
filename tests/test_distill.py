"""`specdecode distill` on a tiny random float32 pair: the loss falls, the adapter loads as
`distilled:DIR` and decodes token for token as the target alone, interrupted runs resume to the
same result, held-out prompts are never trained on, and bad input is one clear message."""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from specdecode import SpeculativeDecoder, load_model
from specdecode.cli import main
from specdecode.core.draft_spec import DraftSpec, ModelSpec
from specdecode.data.suites import load_suite
from specdecode.distill import data as data_module
from specdecode.distill import loss as loss_module
from specdecode.distill import result as result_module
from specdecode.distill import train as train_module
from specdecode.distill.data import AnswerStore
from specdecode.distill.loss import distill_loss
from specdecode.distill.prompts import DistillPrompt, held_out_count, split_heldout
from specdecode.distill.settings import Budget, DistillSettings, parse_temperatures
from specdecode.drafters import resolve_draft
from specdecode.models import files as store_module
from specdecode.models.adapters import read_result

from conftest import char_tokenizer, noisy_copy, tiny_llama

pytest.importorskip("peft")

CHAT = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)
# the built-in suite's held-out prompts at the default share (lab/benchmarks.md lists them)
BUILTIN_HELD_OUT = [
    "code_generation-01", "code_generation-05", "code_editing-04", "code_editing-05",
    "chat-03", "chat-06", "creative_writing-03", "creative_writing-05", "summarization-02",
    "summarization-04", "translation-04", "translation-08", "question_answering-03",
    "question_answering-06", "math_reasoning-01", "math_reasoning-08", "extraction_rag-03",
    "extraction_rag-06",
]  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target, a draft that often disagrees with it, a draft with another tokenizer, and
    a prompt file of two categories x three prompts."""
    root = tmp_path_factory.mktemp("distill-models")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT
    # a context long enough for an instruction to write a prompt from three examples
    target = tiny_llama(seed=0, vocab=len(tokenizer), max_position_embeddings=1024)
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.3))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    other = char_tokenizer(extra="0123456789")
    other.chat_template = CHAT
    tiny_llama(seed=1, vocab=len(other)).save_pretrained(root / "foreign")
    other.save_pretrained(root / "foreign")
    lines = [
        {"id": f"{cat}-{i}", "category": cat, "prompt": f"tell me about {what}, part {i}."}
        for cat, what in (("qa", "the sea"), ("writing", "a cat"))
        for i in "abc"
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def distill_args(pair: Path, out: Path, *extra: str, budget: str = "240") -> list[str]:
    return [
        "distill",
        "--target", str(pair / "target"),
        "--draft", str(pair / "draft"),
        "--prompts", str(pair / "prompts.jsonl"),
        "--out", str(out),
        "--dtype", "float32",
        "--max-new-tokens", "12",
        "--budget", budget,
        "--lr", "1e-2",
        "--batch-size", "2",
        "--lora-rank", "4",
        "--checkpoint-every", "4",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def distilled(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled") / "run"
    assert main(distill_args(pair, out)) == 0
    return out


def adapter_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


def with_data(distilled: Path, out: Path) -> Path:
    """A fresh output folder holding the fixture's cached answers (no answering needed)."""
    out.mkdir(parents=True)
    shutil.copytree(distilled / "data", out / "data")
    return out


# -- pieces -----------------------------------------------------------------------------------


def test_the_builtin_split_is_by_id_and_pinned():
    prompts = load_suite()
    train, held = split_heldout(prompts, 0.25)
    assert [p.id for p in held] == BUILTIN_HELD_OUT  # 2 of the 8 per category
    assert len(train) == len(prompts) - len(held) and not {p.id for p in train} & set(
        BUILTIN_HELD_OUT
    )
    _, held_again = split_heldout(list(reversed(prompts)), 0.25)  # the order does not matter
    assert {p.id for p in held_again} == set(BUILTIN_HELD_OUT)
    assert [held_out_count(n, 0.25) for n in (1, 2, 3, 8, 9)] == [0, 1, 1, 2, 2]
    assert held_out_count(4, 0.99) == 3 and held_out_count(8, 0) == 0  # one is always trained on


def test_budgets_and_temperatures_parse_or_say_what_they_take():
    assert Budget.parse("30m").seconds == 1800 and Budget.parse("1.5h").seconds == 5400
    assert Budget.parse("90s").seconds == 90 and Budget.parse("5ms").seconds == 0.005
    assert Budget.parse("200k").tokens == 200_000 and Budget.parse("2M").tokens == 2_000_000
    assert Budget.parse("5000").tokens == 5000
    for bad in ("0", "-3", "abc", "1.5", "10 minutes", ""):
        with pytest.raises(ValueError, match="a budget is a training time"):
            Budget.parse(bad)
    assert parse_temperatures("0, 0.7,0") == [0.0, 0.7]
    for bad in ("", "hot", "-1"):
        with pytest.raises(ValueError, match="--temperatures"):
            parse_temperatures(bad)


def test_the_loss_is_zero_at_the_target_and_positive_elsewhere():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(5, 40, generator=gen) * 3  # [T, V]
    top = torch.log_softmax(target, -1).topk(8, dim=-1)
    tail = 1 - top.values.exp().sum(-1)
    for kind in ("kl", "tv"):
        assert distill_loss(target, top.values.half(), top.indices.int(), tail, kind).abs().max() < 2e-3  # fmt: skip
        other = torch.randn(5, 40, generator=gen, requires_grad=True)
        loss = distill_loss(other, top.values.half(), top.indices.int(), tail, kind)
        assert (loss > 0.01).all()
        loss.sum().backward()
        assert torch.isfinite(other.grad).all()
    # the top-k covering the vocabulary: an empty tail, finite gradients
    full = torch.log_softmax(target, -1).topk(40, dim=-1)
    other = torch.randn(5, 40, generator=gen, requires_grad=True)
    loss = distill_loss(other, full.values.half(), full.indices.int(), torch.zeros(5), "kl")
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(other.grad).all()


def test_the_loss_is_the_exact_distance_on_the_buckets_at_any_tail_mass():
    """The draft's tail log-mass is 1 - sum(q_top) where float32 keeps its digits and an exact
    log-sum-exp where it does not (a draft sure of its top tokens): both equal the reference."""
    gen = torch.Generator().manual_seed(3)
    vocab, k = 50, 6
    target = torch.randn(8, vocab, generator=gen) * 2
    top = torch.log_softmax(target, -1).topk(k, dim=-1)
    tail = 1 - top.values.exp().sum(-1)
    exact = 0
    for scale in (0.5, 4.0, 40.0):  # a flat draft to one with next to no mass outside the top
        noise = torch.randn(8, vocab, generator=gen, dtype=torch.float64)
        draft = target.double() * scale + noise  # sure of the target's top tokens as it grows
        logq = draft.log_softmax(-1)
        mask = torch.zeros_like(logq, dtype=torch.bool).scatter(-1, top.indices, True)
        q_tail = logq.masked_fill(mask, float("-inf")).logsumexp(-1).exp()
        p_top = top.values.half().double().exp()
        norm = p_top.sum(-1) + tail.double()
        p_top, p_tail = p_top / norm[:, None], tail.double() / norm
        q_top = logq.gather(-1, top.indices).exp()
        kl = (p_top * (p_top / q_top).log()).sum(-1) + p_tail * (p_tail / q_tail).log()
        exact += int((q_tail < loss_module.EXACT_TAIL).sum())
        tv = 0.5 * ((p_top - q_top).abs().sum(-1) + (p_tail - q_tail).abs())
        for kind, want in (("kl", kl), ("tv", tv)):
            got = distill_loss(draft.float(), top.values.half(), top.indices.int(), tail, kind)
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert 0 < exact < 24  # both ways of taking the tail were used


def test_the_output_layer_at_answer_positions_gives_the_whole_forwards_logits(monkeypatch):
    model = train_module.add_lora(tiny_llama(seed=0), 4, 8.0)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(0))
    rows, cols = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([3, 4, 10, 0, 5, 6])
    whole = model(input_ids=ids).logits[rows, cols]  # [6, V]
    monkeypatch.setattr(train_module, "LOSS_PART_BYTES", 4 * 96 * 4)  # parts of 4 positions
    parts = list(train_module.answer_logits(model, ids, rows, cols))
    assert [span for span, _ in parts] == [slice(0, 4), slice(4, 8)]
    picked = torch.cat([logits for _, logits in parts])
    torch.testing.assert_close(picked, whole, rtol=1e-5, atol=1e-5)


def test_a_model_that_caps_its_logits_is_cut_from_its_whole_forward(monkeypatch):
    # Gemma 2 caps its logits after the output layer (cap * tanh(logits / cap)): the output
    # layer alone would give other logits, so answer_logits runs the model whole, then cuts
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    rows, cols = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 8, 0, 4, 5])
    whole = model(input_ids=ids).logits[rows, cols]  # [5, V]
    uncapped = model.lm_head(model.get_decoder()(input_ids=ids).last_hidden_state[rows, cols])
    assert whole.abs().max() <= 0.5 and not torch.allclose(uncapped, whole, atol=1e-3)
    monkeypatch.setattr(train_module, "LOSS_PART_BYTES", 2 * 96 * 4)  # parts of 2 positions
    parts = list(train_module.answer_logits(model, ids, rows, cols))
    assert [span for span, _ in parts] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    torch.testing.assert_close(torch.cat([logits for _, logits in parts]), whole)


def test_distilled_draft_specs_parse_and_print_back():
    spec = DraftSpec.parse("distilled:runs/d:int4")
    assert spec == DraftSpec("distilled", model=ModelSpec("runs/d", "int4"))
    assert spec.distilled_dir == "runs/d" and spec.is_model_draft
    assert str(spec) == "distilled:runs/d:int4" and DraftSpec.parse(str(spec)) == spec
    assert DraftSpec.parse("distilled:/a:b").distilled_dir == "/a:b"  # a colon in the folder
    for bad, message in (("distilled", "needs its folder"), ("distilled:", "needs its folder")):
        with pytest.raises(ValueError, match=message):
            DraftSpec.parse(bad)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        DraftSpec.parse("distilled:d:int3")


# -- a whole distillation ---------------------------------------------------------------------


def test_the_loss_falls_and_the_distilled_draft_is_lossless(pair, distilled):
    record = read_result(distilled)
    training = record["training"]
    assert training["steps"] >= 5 and len(training["curve"]) == training["steps"]
    assert training["tokens"] <= 240  # the budget
    assert training["loss_after"] < 0.7 * training["loss_before"]
    assert record["draft"] == str(pair / "draft") and record["target"] == str(pair / "target")

    target = load_model(pair / "target", dtype="float32")
    draft = resolve_draft(f"distilled:{distilled}", target, dtype="float32")
    assert draft.name == f"distilled:{distilled}"
    # merged: a plain model, no adapter modules left for the kernels or the lean forward to meet
    assert not any("lora" in name for name, _ in draft.model.named_modules())
    original = resolve_draft(str(pair / "draft"), target, dtype="float32")
    ar = SpeculativeDecoder(target)
    accepted = {"original": [0, 0], "distilled": [0, 0]}
    for prompt in load_suite(pair / "prompts.jsonl"):
        text = prompt.turns[0]
        expected = ar.generate(text, max_new_tokens=20, chat=True).token_ids
        for name, d in (("original", original), ("distilled", draft)):
            for tree in (None, "static:2,2,1"):
                out = SpeculativeDecoder(target, d, k=3, tree=tree, k_policy="fixed").generate(
                    text, max_new_tokens=20, chat=True
                )
                assert out.token_ids == expected, (name, tree, prompt.id)  # lossless
                if tree is None and prompt.id in record["data"]["train_prompt_ids"]:
                    accepted[name][0] += out.stats.accepted
                    accepted[name][1] += out.stats.drafted
    rate = {name: a / d for name, (a, d) in accepted.items()}
    assert rate["distilled"] > rate["original"]  # it learnt what the target says


def test_held_out_prompts_are_never_answered(pair, distilled):
    record = read_result(distilled)
    data = record["data"]
    assert data["heldout_prompt_ids"] == ["qa-a", "writing-a"]
    assert data["train_prompt_ids"] == ["qa-b", "qa-c", "writing-b", "writing-c"]
    manifest = json.loads((distilled / "data" / "manifest.json").read_text())
    answered = {key.split("|")[0] for keys in manifest["shards"].values() for key in keys}
    assert answered == set(data["train_prompt_ids"])
    assert data["answers"] == 8  # 4 prompts x (greedy + one sample at 0.7)


def test_an_interrupted_training_resumes_to_the_same_adapter(
    pair, distilled, tmp_path, monkeypatch, capsys
):
    out = with_data(distilled, tmp_path / "run")
    real, calls = train_module._one_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "_one_step", interrupted)
    assert main(distill_args(pair, out)) == 130
    err = capsys.readouterr().err
    assert "interrupted at training step 5" in err and "Run the same command again" in err
    assert "Traceback" not in err and (out / "checkpoints" / "step-0000005.pt").exists()
    with pytest.raises(ValueError, match=r"no distill\.json \(an unfinished distillation"):
        read_result(out)
    monkeypatch.setattr(train_module, "_one_step", real)
    assert main(distill_args(pair, out)) == 0
    resumed, whole = adapter_weights(out), adapter_weights(distilled)
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name
    assert read_result(out)["training"]["curve"] == read_result(distilled)["training"]["curve"]
    # other training settings do not resume these checkpoints
    assert main(distill_args(pair, out, "--lr", "1e-3")) == 2
    assert "trained with other settings (lr differ)" in capsys.readouterr().err


def test_an_interrupted_answering_resumes_where_it_stopped(
    pair, distilled, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    real, calls = data_module.AnswerStore.add, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(data_module.AnswerStore, "add", counted)
    args = distill_args(pair, out, "--categories", "qa", budget="50")
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted while the target answered: 2 of 4 answers are cached" in err
    calls.clear()
    assert main(args) == 0
    assert len(calls) == 2  # only the missing answers
    key = json.loads((out / "data" / "config.json").read_text())["settings"]
    store, whole = AnswerStore(out / "data", key), AnswerStore(distilled / "data", key)
    keys = sorted(store.done())
    for mine, theirs in zip(store.load(keys), whole.load(keys), strict=True):
        assert torch.equal(mine.answer_ids, theirs.answer_ids)
        assert torch.equal(mine.top_ids, theirs.top_ids)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_kept_distributions_are_the_targets_on_its_answers(pair, tmp_path, rows):
    """The distributions kept from the forwards that decoded each answer (one at a time with
    the draft, or batched) are those of one teacher-forced forward over prompt + answer."""
    from specdecode.bench.quality import answer_log_probs
    from specdecode.distill.data import make_answers, plan_answers, top_distributions

    target = load_model(str(pair / "target"), dtype=torch.float32)
    draft = load_model(str(pair / "draft"), dtype=torch.float32) if rows == 1 else None
    engine = SpeculativeDecoder(target, draft, k=3, generation_config="none", k_policy="fixed")
    prompts = [
        DistillPrompt(f"p{i}", "qa", text) for i, text in enumerate(["tell me", "a cat is", "x"])
    ]
    planned = plan_answers(prompts, (0.0, 0.8), 1)
    store = AnswerStore(tmp_path / "data", {"rows": rows})
    assert make_answers(engine, planned, store, 40, 5, 10, chat=False, progress=False, rows=rows)
    for answer in store.load([p.key for p in planned]):
        prompt_ids, answer_ids = answer.prompt_ids.tolist(), answer.answer_ids.tolist()
        values, ids, tail = top_distributions(
            answer_log_probs(target.model, prompt_ids, answer_ids), 40, 5
        )
        assert torch.equal(answer.top_ids, ids), answer.key
        torch.testing.assert_close(answer.top_logprobs, values, atol=2e-3, rtol=0)
        torch.testing.assert_close(answer.tail, tail, atol=1e-4, rtol=0)


def test_batched_answers_are_the_answers_made_one_at_a_time():
    from specdecode.core.request import GenerationRequest
    from specdecode.core.sampling import SamplingParams
    from specdecode.runtime.session import JobError, generate_each

    engine = SpeculativeDecoder(tiny_llama(seed=3), None, generation_config="none")
    prompts = [[1 + i, 5 + 2 * i, 9, 4 + i][: 2 + i % 3] for i in range(7)]
    jobs = [
        (ids, GenerationRequest(8 + i, SamplingParams(temperature=0.7 * (i % 2)), seed=i))
        for i, ids in enumerate(prompts)
    ]
    alone = dict(generate_each(engine, jobs, rows=1))
    batched = list(generate_each(engine, jobs, rows=3))
    assert sorted(i for i, _ in batched) == list(range(7))  # each job once, as it finished
    for index, result in batched:
        assert result.token_ids == alone[index].token_ids, index
        assert len(result.token_ids) == 8 + index  # no EOS in the tiny model's ids
    too_long = [jobs[0], ([1] * 4096, GenerationRequest(4))]
    for rows in (1, 3):
        with pytest.raises(JobError) as caught:
            list(generate_each(engine, too_long, rows))
        assert caught.value.index == 1


def test_the_target_writes_prompts_when_asked(pair, tmp_path):
    out = tmp_path / "run"
    args = distill_args(pair, out, "--temperatures", "0", budget="30")
    args[args.index("--prompts") : args.index("--prompts") + 2] = []  # the built-in suite
    assert main([*args, "--categories", "chat", "--self-prompts", "1"]) == 0
    record = read_result(out)
    assert record["data"]["self_prompt_ids"] == ["self-chat-001"]
    assert record["data"]["self_prompts"]["written"] == 1
    assert len(record["data"]["train_prompt_ids"]) == 6  # the suite's chat prompts, 2 held out
    assert not set(record["data"]["heldout_prompt_ids"]) & set(record["data"]["train_prompt_ids"])
    rows = [json.loads(r) for r in (out / "data" / "self_prompts.jsonl").read_text().splitlines()]
    assert [r["category"] for r in rows] == ["chat"]
    assert len(rows[0]["examples"]) == 3  # written from three of the training prompts
    assert set(rows[0]["examples"]) <= set(record["data"]["train_prompt_ids"])


def test_the_target_writes_prompts_like_a_users_own(pair, tmp_path):
    out = tmp_path / "run"
    args = distill_args(pair, out, "--temperatures", "0", "--self-prompts", "2", budget="30")
    assert main(args) == 0
    data = read_result(out)["data"]
    ids = ["self-qa-001", "self-qa-002", "self-writing-001", "self-writing-002"]
    assert data["self_prompt_ids"] == ids
    rows = [json.loads(r) for r in (out / "data" / "self_prompts.jsonl").read_text().splitlines()]
    shown = {e for r in rows for e in r["examples"]}
    # the categories' training prompts (2 of 3 each: one held out), never a held-out one
    assert shown == set(data["train_prompt_ids"]) and len(shown) == 4
    assert not shown & set(data["heldout_prompt_ids"])


def test_self_written_prompts_follow_their_examples_in_turn():
    from specdecode.distill.prompts import (
        EXAMPLES_SHOWN,
        _clean,
        examples_for,
        fitting_instruction,
        instruction,
    )

    pool = [DistillPrompt(f"chat-{i}", "chat", f"question {i}?") for i in range(5)]
    shown = [examples_for(pool, attempt) for attempt in range(5)]
    assert all(len(s) == EXAMPLES_SHOWN for s in shown)
    assert [s[0].id for s in shown] == [p.id for p in pool]  # each prompt leads once in turn
    assert [p.id for p in examples_for(pool[:2], 0)] == ["chat-0", "chat-1"]  # no repeats
    text = instruction("chat", shown[0], 0)
    assert all(p.text in text for p in shown[0]) and "question 3?" not in text
    assert "about cooking at home" in text  # a built-in category's first seed topic
    own = instruction("tickets", [DistillPrompt("t-1", "tickets", "x" * 4000)], 0)
    assert "about" not in own and len(own) < 2000  # no topic; a long example is cut
    assert _clean(' Request 4: "Write a haiku about rain."\n') == "Write a haiku about rain."

    def encode(text: str) -> list[int]:
        return list(text.encode())

    ids, fits = fitting_instruction(encode, "chat", pool, 0, room=len(encode(text)) - 1)
    assert [p.id for p in fits] == ["chat-0", "chat-1"]  # three would leave too little room
    assert ids == encode(instruction("chat", fits, 0))
    ids, fits = fitting_instruction(encode, "chat", pool, 0, room=1)
    assert len(fits) == 1  # and one is kept, to be refused with the prompt's length named


def test_cached_self_written_prompts_from_a_held_out_example_are_written_again(tmp_path):
    from specdecode.distill.prompts import PROMPT_FORM, SELF_PROMPTS_FILE, cached_self_prompts

    train = [DistillPrompt("chat-1", "chat", "a"), DistillPrompt("chat-2", "chat", "b")]
    rows = [
        {"id": "self-chat-001", "category": "chat", "prompt": "c", "form": PROMPT_FORM,
         "examples": ["chat-1", "chat-2"]},
        {"id": "self-chat-002", "category": "chat", "prompt": "d", "form": PROMPT_FORM,
         "examples": ["chat-2", "chat-3"]},  # chat-3 is held out now
        {"id": "self-chat-003", "category": "chat", "prompt": "e", "topic": "gardening"},
    ]  # fmt: skip
    (tmp_path / SELF_PROMPTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.id for p in cached_self_prompts(tmp_path, train, 1)] == ["self-chat-001"]
    assert cached_self_prompts(tmp_path, train, 2) is None  # the other two are written again


def test_bfloat16_autocast_is_chosen_where_measured_faster_and_trains(monkeypatch):
    cpu = torch.device("cpu")
    probe = train_module.autocast_probe(cpu)  # measured on this machine: both ran
    assert set(probe) == {"float32", "bfloat16"} and all(ms > 0 for ms in probe.values())
    bf16 = DistillSettings("t", "d", "o")  # a bfloat16 draft, --autocast auto
    for faster, expected in (("bfloat16", torch.bfloat16), ("float32", None)):
        times = {"float32": 2.0, "bfloat16": 2.0, faster: 1.0}
        monkeypatch.setattr(train_module, "autocast_probe", lambda device, t=times: t)
        assert train_module.autocast_dtype(bf16, cpu) == expected, faster
    # asked for, bf16 runs whatever the probe says
    assert train_module.autocast_dtype(DistillSettings("t", "d", "o", autocast="bf16"), cpu) == (
        torch.bfloat16
    )
    as_fp32 = DistillSettings("t", "d", "o", dtype="float32")
    assert train_module.autocast_dtype(as_fp32, cpu) is None
    assert train_module.autocast_dtype(DistillSettings("t", "d", "o", autocast="off"), cpu) is None
    model = train_module.add_lora(tiny_llama(seed=0), 4, 8.0)
    gen = torch.Generator().manual_seed(0)
    answer = data_module.Answer(
        "k", "p", "c", 0.0,
        prompt_ids=torch.tensor([1, 2, 3], dtype=torch.int32),
        answer_ids=torch.tensor([4, 5], dtype=torch.int32),
        top_logprobs=torch.log_softmax(torch.randn(2, 96, generator=gen), -1).topk(8).values.half(),
        top_ids=torch.randint(0, 96, (2, 8), generator=gen, dtype=torch.int32),
        tail=torch.full((2,), 0.5),
    )  # fmt: skip
    loss = train_module.answer_loss(model, answer, 96, "kl", cpu, torch.bfloat16)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # float32 master weights


def test_a_padded_batch_loses_what_its_answers_lose_one_at_a_time():
    cpu, vocab = torch.device("cpu"), 96
    model = train_module.add_lora(tiny_llama(seed=0), 4, 8.0)
    gen = torch.Generator().manual_seed(1)

    def answer(prompt: int, tokens: int) -> data_module.Answer:
        top = torch.log_softmax(torch.randn(tokens, vocab, generator=gen), -1).topk(8)
        return data_module.Answer(
            "k", "p", "c", 0.0,
            prompt_ids=torch.randint(1, vocab, (prompt,), generator=gen, dtype=torch.int32),
            answer_ids=torch.randint(1, vocab, (tokens,), generator=gen, dtype=torch.int32),
            top_logprobs=top.values.half(),
            top_ids=top.indices.int(),
            tail=(1 - top.values.exp().sum(-1)).clamp(min=0),
        )  # fmt: skip

    batch = [answer(3, 5), answer(7, 2), answer(1, 9)]  # ragged prompts and answers
    alone = sum(train_module.answer_loss(model, a, vocab, "kl", cpu, None) for a in batch)
    together = train_module.batch_loss(model, batch, vocab, "kl", cpu, None)
    assert float(alone.detach()) > 0
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
    together.backward()  # gradients reach the adapters
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# -- what is refused --------------------------------------------------------------------------


def test_a_half_written_result_never_loads(pair, distilled, tmp_path, monkeypatch):
    target = load_model(pair / "target", dtype="float32")
    copy = tmp_path / "copy"
    shutil.copytree(distilled, copy)
    (copy / "distill.json").unlink()  # as an interrupted final write leaves it
    with pytest.raises(ValueError, match=r"no distill\.json \(an unfinished distillation"):
        resolve_draft(f"distilled:{copy}", target, dtype="float32")

    shutil.copytree(distilled, tmp_path / "changed")
    weights = tmp_path / "changed" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"is not the adapter distill\.json records"):
        resolve_draft(f"distilled:{tmp_path / 'changed'}", target, dtype="float32")
    with pytest.raises(ValueError, match="no such folder"):
        resolve_draft(f"distilled:{tmp_path / 'none'}", target, dtype="float32")

    # the final write stopped between removing the old record and writing the new one
    again = tmp_path / "again"
    shutil.copytree(distilled, again)
    shutil.rmtree(again / "adapter")
    monkeypatch.setattr(
        result_module, "replace_folder", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    model = train_module.add_lora(load_model(pair / "draft", dtype="float32").model, 4, 8.0)
    with pytest.raises(KeyboardInterrupt):
        result_module.write_result(again, model, read_result(distilled))
    assert (again / ".adapter.partial").is_dir() and not (again / "distill.json").exists()
    with pytest.raises(ValueError, match="unfinished distillation"):
        read_result(again)


def test_the_calibration_keys_a_distilled_draft_by_its_adapter(distilled):
    from specdecode.auto.calibrate import canonical_draft

    sha = read_result(distilled)["adapter"]["sha256"]
    assert (
        canonical_draft(f"distilled:{distilled}:int4") == f"distilled:{distilled}:int4@{sha[:16]}"
    )


def test_a_distilled_draft_checks_its_target(pair, distilled, capsys):
    foreign = load_model(pair / "foreign", dtype="float32")
    with pytest.raises(ValueError, match="the target's tokenizer is not the one it was distilled"):
        resolve_draft(f"distilled:{distilled}", foreign, dtype="float32")
    draft_as_target = load_model(pair / "draft", dtype="float32")  # same tokenizer, other name
    resolve_draft(f"distilled:{distilled}", draft_as_target, dtype="float32")
    assert "was trained for" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--budget", "soon"], "bad --budget 'soon'"),
        (["--temperatures", "warm"], "bad --temperatures"),
        (["--draft", "ngram"], "distill trains a draft model"),
        (["--holdout", "1"], "--holdout is a share"),
        (["--categories", "poetry"], "no prompts to distil on: .*unknown category 'poetry'"),
    ],
)
def test_bad_options_fail_before_loading(pair, tmp_path, capsys, extra, message):
    assert main([*distill_args(pair, tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdecode: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not (tmp_path / "run" / "data").exists()  # nothing was loaded or written


def test_bad_input_is_one_clear_line(pair, distilled, tmp_path, monkeypatch, capsys):
    def fails(argv: list[str], code: int, message: str) -> None:
        assert main(argv) == code
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    args = distill_args(pair, tmp_path / "a")
    args[args.index("--prompts") + 1] = str(empty)
    fails(args, 2, "no prompts to distil on: ")
    args = distill_args(pair, tmp_path / "b")
    args[args.index("--draft") + 1] = str(pair / "foreign")
    fails(args, 2, "cannot be distilled for target (distilling needs the target's tokenizer): incompatible tokenizers")  # fmt: skip
    # no room in the context for a prompt written from even one example, and its answer
    args = distill_args(pair, tmp_path / "f", "--self-prompts", "1", "--max-new-tokens", "1000")
    fails(args, 2, "--self-prompts, writing from prompt 'qa-")
    # budgets too small for one step: nothing is trained and no adapter written
    fails(distill_args(pair, with_data(distilled, tmp_path / "c"), budget="5"), 2, "--budget 5 is too small for one training step (its first step trains")  # fmt: skip
    fails(distill_args(pair, with_data(distilled, tmp_path / "d"), budget="1ms"), 2, "--budget 1ms is too small for one training step (the first step took")  # fmt: skip
    assert not (tmp_path / "c" / "distill.json").exists()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.torch, "save", full)
    out = with_data(distilled, tmp_path / "e")
    fails(distill_args(pair, out), 1, "the disk is full: writing checkpoint step-0000004.pt")
    assert not list(out.rglob("*.partial")) and not (out / "distill.json").exists()
    monkeypatch.undo()
    assert main(distill_args(pair, out)) == 0  # resumes once there is room


# -- benchmarks/distill_gain.py ---------------------------------------------------------------


def _gain_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "distill_gain.py"
    spec = importlib.util.spec_from_file_location("distill_gain", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gain_is_measured_on_the_held_out_prompts(distilled, tmp_path, capsys):
    gain = _gain_module()
    out = tmp_path / "gain"
    argv = [str(distilled), "--dtype", "float32", "--max-new-tokens", "12", "--k", "2"]
    argv += ["--tree", "static:2,1", "--out", str(out)]
    assert gain.main([*argv, "--dry-run"]) is None and not out.exists()  # loads nothing
    result = gain.main(argv)
    held = [json.loads(line)["id"] for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert held == ["qa-a", "writing-a"]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["prompt_id"] for r in records} == set(held)
    assert all(r["identical_to_ar"] for r in records)  # float32: lossless with both drafts
    assert {r["draft"] for r in records if r["method"] == "spec"} == {
        result["original"],
        result["distilled"],
    }
    cells = {(e["category"], e["setting"]) for e in result["gain"]}
    for category in ("all", "qa", "writing"):
        assert {(category, s) for s in ("k=2", "tree=static:2,1", "best tree")} <= cells
    for entry in result["gain"]:
        assert None not in (entry["alpha_original"], entry["alpha_distilled"])
        assert entry["alpha_gain"] == pytest.approx(
            entry["alpha_distilled"] - entry["alpha_original"]
        )
    assert "| qa | k=2 |" in (out / "gain.md").read_text()


def test_the_gain_verdict_reads_the_issue_bar():
    gain = _gain_module()

    def entry(category, setting, alpha_gain, ratio):
        return {"category": category, "setting": setting, "alpha_gain": alpha_gain,
                "speedup_ratio": ratio}  # fmt: skip

    table = [
        entry("chat", "k=4", 0.12, 1.3),
        entry("chat", "best tree", 0.15, 1.25),
        entry("translation", "k=4", 0.05, 1.1),
        entry("translation", "best tree", 0.2, 1.3),
        entry("code_generation", "k=4", 0.0, 1.0),  # not one of the unsure categories
    ]
    lines = gain.verdicts(table)
    assert len(lines) == 2
    assert lines[0].startswith("chat: α gain +0.12, +0.15 (met") and "1.25x (met" in lines[0]
    assert lines[1].startswith("translation: α gain +0.05, +0.20 (not met")
