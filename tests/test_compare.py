"""`specdecode compare`: pruned and quantized variants, quality statistics, the task set, the
command's output and its bad input, on tiny random models."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from specdecode.bench.compare import CompareConfig, run_compare, split_prompts
from specdecode.bench.quality import (
    answer_log_probs,
    measure_quality,
    summarize_tokens,
    token_quality,
)
from specdecode.bench.variants import (
    Variant,
    calibration_sequences,
    check_fits,
    check_variants,
    make_variant,
    parse_variants,
    quantized_target,
)
from specdecode.cli import main
from specdecode.data.suites import BenchPrompt
from specdecode.data.tasks import check_answer, extract_code, load_tasks, pass_rates, run_code
from specdecode.models import prune
from specdecode.models.loading import LoadedModel
from specdecode.runtime.engine import SpeculativeDecoder

from conftest import char_tokenizer, needs_kernel, noisy_copy, tiny_gpt2, tiny_llama

ROW_KEYS = {
    "variant",
    "speculative",
    "kld_mean",
    "kld_p99",
    "top1_agreement",
    "perplexity",
    "task_pass_rate",
    "decode_speedup",
    "e2e_speedup",
    "tokens_per_s",
    "memory_bytes",
    "lossless_to",
}
CHAT = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)


def _sequences(n: int = 3, length: int = 12, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _make_identity(layer) -> None:
    """A decoder layer whose output is its input: both residual branches write zeros."""
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


# -- pruning ------------------------------------------------------------------------------------


def test_drop_layers_picks_the_least_influential_layers():
    model = tiny_llama(0, layers=5)
    for index in (1, 3):  # these two change nothing: block influence 0
        _make_identity(model.model.layers[index])
    scores = prune.block_influence(model, _sequences())
    assert scores[1] == pytest.approx(0.0, abs=1e-6) and scores[3] == pytest.approx(0.0, abs=1e-6)
    assert min(scores[i] for i in (0, 2, 4)) > 1e-3
    assert prune.least_influence(scores, 2) == [1, 3]

    reference = LoadedModel(model, None, "tiny")
    before = _logits(model, [5, 6, 7, 8])
    pruned, info = make_variant(reference, Variant("drop-layers", 2), _sequences())
    assert info["dropped_layers"] == [1, 3]
    assert pruned.model.config.num_hidden_layers == 3 and len(pruned.model.model.layers) == 3
    assert [layer.self_attn.layer_idx for layer in pruned.model.model.layers] == [0, 1, 2]
    assert _params(pruned.model) < _params(model)
    # dropping layers that did nothing leaves the output as it was; the reference is untouched
    assert torch.allclose(_logits(pruned.model, [5, 6, 7, 8]), before, atol=1e-5)
    assert model.config.num_hidden_layers == 5 and len(model.model.layers) == 5
    assert torch.equal(_logits(model, [5, 6, 7, 8]), before)
    # it decodes with a cache over its renumbered layers, as its own forward predicts
    out = SpeculativeDecoder(pruned.model).generate([5, 6, 7], max_new_tokens=6, temperature=0.0)
    tokens = [5, 6, 7]
    for _ in range(6):
        tokens.append(int(_logits(pruned.model, tokens)[-1].argmax()))
    assert out.token_ids == tokens[3:]


def test_prune_mlp_really_shrinks_the_matrices():
    model = tiny_llama(1, layers=2)  # intermediate 64, hidden 32
    reference = LoadedModel(model, None, "tiny")
    pruned, info = make_variant(reference, Variant("prune-mlp", 0.25), _sequences())
    assert info["intermediate_size"] == 48 and info["removed_fraction"] == pytest.approx(0.25)
    assert pruned.model.config.intermediate_size == 48
    for layer in pruned.model.model.layers:
        mlp = layer.mlp
        assert mlp.gate_proj.weight.shape == (48, 32) and mlp.up_proj.weight.shape == (48, 32)
        assert mlp.down_proj.weight.shape == (32, 48)
    assert _params(model) - _params(pruned.model) == 2 * 3 * 16 * 32
    assert model.config.intermediate_size == 64  # the reference keeps its own
    assert model.model.layers[0].mlp.down_proj.weight.shape == (32, 64)
    SpeculativeDecoder(pruned.model).generate([3, 4], max_new_tokens=4, temperature=0.0)


def test_prune_mlp_removes_the_channels_that_contribute_nothing():
    model = tiny_llama(2, layers=2)
    dead = torch.arange(0, 64, 4)  # 16 channels whose down_proj columns are zero
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[:, dead] = 0.0
    scores = prune.mlp_channel_scores(model, _sequences())
    assert all(torch.all(s[dead] == 0) and torch.all(s[s != 0] > 0) for s in scores)
    before = _logits(model, [9, 8, 7])
    pruned, _ = make_variant(LoadedModel(model, None, "tiny"), Variant("prune-mlp", 0.25), [[1, 2]])
    assert torch.allclose(_logits(pruned.model, [9, 8, 7]), before, atol=1e-5)
    kept = prune.top_channels(scores[0], 48)
    assert not set(kept.tolist()) & set(dead.tolist())


def test_kept_channels_rounds_to_panels_and_refuses_bad_fractions():
    assert prune.kept_channels(8960, 0.25) == 6720  # 420 panels of 16
    assert prune.kept_channels(1536, 0.25) == 1152
    assert prune.kept_channels(64, 0.5) == 32
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"fraction in \(0, 1\)"):
            prune.kept_channels(64, bad)


# -- quality ------------------------------------------------------------------------------------


def test_a_model_against_itself_has_no_divergence():
    model = tiny_llama(3)
    texts = [("a", [4, 5, 6], [7, 8, 9, 10]), ("b", [11, 12], [13, 14])]
    quality = measure_quality(model, {"same": model, "copy": copy.deepcopy(model)}, texts, False)
    for name in ("same", "copy"):
        overall = quality[name]["all"]
        assert overall["tokens"] == 6
        assert overall["kld_mean"] == 0.0 and overall["kld_p99"] == 0.0
        assert overall["top1_agreement"] == 1.0
    assert set(quality["same"]) == {"all", "a", "b"}
    other = measure_quality(model, {"other": tiny_llama(4)}, texts, False)["other"]["all"]
    assert other["kld_mean"] > 0 and other["top1_agreement"] < 1


def test_kl_divergence_and_perplexity_match_a_hand_computation():
    ref = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]]))
    var = torch.log(torch.tensor([[0.25, 0.75, 0.0], [0.25, 0.25, 0.5]]))
    part = token_quality(ref, var, [1, 2])
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # the 0 log 0 term adds 0
    assert part.kld.tolist() == pytest.approx([kl0, 0.0])
    assert part.agree.tolist() == [False, True]  # argmax 0 vs 1; 2 vs 2
    stats = summarize_tokens([part])
    assert stats["perplexity"] == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.5)) / 2))
    assert stats["kld_mean"] == pytest.approx(kl0 / 2)
    assert stats["top1_agreement"] == 0.5


def test_answer_log_probs_are_the_teacher_forced_positions():
    model = tiny_llama(5)
    prompt, answer = [3, 4, 5], [6, 7]
    full = torch.log_softmax(_logits(model, prompt + answer).float(), -1)  # [5, V]
    assert torch.allclose(answer_log_probs(model, prompt, answer), full[2:4], atol=1e-6)
    gpt2 = tiny_gpt2(0)  # a model without logits_to_keep works the same way
    full = torch.log_softmax(_logits(gpt2, prompt + answer).float(), -1)
    assert torch.allclose(answer_log_probs(gpt2, prompt, answer), full[2:4], atol=1e-6)


@needs_kernel()
def test_answer_log_probs_score_the_forward_a_target_decodes_with():
    from specdecode.kernels import quantize_linears, swap_linears
    from specdecode.models.lean import LeanCache, target_cache

    model = tiny_llama(5, hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    swap_linears(model)
    quantize_linears(model, bits=4)  # a 4-bit target: the lean forward, float32 hidden states
    prompt, answer = [3, 4, 5], [6, 7]
    cache = target_cache(model)
    assert isinstance(cache, LeanCache) and cache.residual == torch.float32
    with torch.inference_mode():
        full = torch.log_softmax(cache.forward(torch.tensor(prompt + answer)).float(), -1)
    assert torch.equal(answer_log_probs(model, prompt, answer), full[2:4])


# -- tasks --------------------------------------------------------------------------------------


def test_the_task_set_is_whole_and_its_own_solutions_pass():
    tasks = load_tasks()
    code = [t for t in tasks if t.kind == "code"]
    math_tasks = [t for t in tasks if t.kind == "math"]
    assert len(code) == 40 and len(math_tasks) == 40
    assert len({t.id for t in tasks}) == 80
    for task in code:  # in this process: fast, and each in a fresh namespace
        assert f"def {task.entry_point}(" in task.solution, task.id
        exec(compile(task.solution + "\n" + task.tests, task.id, "exec"), {})
    data = Path(__file__).parents[1] / "src/specdecode/data/tasks/math_tasks.jsonl"
    for line in data.read_text().splitlines():
        row = json.loads(line)
        assert eval(row["work"]) == pytest.approx(row["answer"]), row["id"]
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"data/tasks/*.jsonl"' in pyproject  # installed with the package
    assert len(load_tasks(3)) == 6


def test_the_task_runner_passes_a_solution_and_fails_wrong_ones():
    task = next(t for t in load_tasks(1) if t.kind == "code")  # add_numbers
    good = f"Here it is:\n```python\n{task.solution}```\nDone."
    assert extract_code(good).strip() == task.solution.strip()
    assert check_answer(task, good).passed
    wrong = check_answer(task, "```python\ndef add_numbers(a, b):\n    return a - b\n```")
    assert not wrong.passed and "AssertionError" in wrong.reason
    slow = run_code("while True:\n    pass", "", timeout_s=1.0)
    assert not slow.passed and "timed out" in slow.reason
    network = run_code("import socket\nsocket.create_connection(('127.0.0.1', 9))", "")
    assert not network.passed and "network access is disabled" in network.reason
    number = next(t for t in load_tasks(1) if t.kind == "math")  # 12 * 7
    assert check_answer(number, "12 boxes of 7: the answer is 84.").passed
    assert not check_answer(number, "85").passed and not check_answer(number, "many").passed
    rates = pass_rates([{"kind": "code", "passed": True}, {"kind": "math", "passed": False}])
    assert rates["all"] == {"passed": 1, "total": 2, "rate": 0.5}


# -- the command --------------------------------------------------------------------------------


def _tiny_pair(dtype=torch.float32):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT
    target = tiny_llama(0, vocab=len(tokenizer), layers=3, max_position_embeddings=1024)
    draft = noisy_copy(target, 0.05)
    return (
        LoadedModel(target.to(dtype), tokenizer, "target"),
        LoadedModel(draft.to(dtype), tokenizer, "draft"),
    )


def _prompt_file(tmp_path: Path) -> str:
    lines = [
        {"id": "w1", "category": "writing", "prompt": "tell me a story."},
        {"id": "w2", "category": "writing", "prompt": "a poem about the sea."},
        {"id": "q1", "category": "qa", "prompt": "why is the sky blue?"},
        {"id": "q2", "category": "qa", "prompt": "what is a lighthouse?"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_compare_writes_its_rows_on_a_tiny_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target, draft = _tiny_pair()
    config = CompareConfig(
        target="target",
        draft="draft",
        variants=["drop-layers=1", "prune-mlp=0.25"],
        ks=[2],
        max_new_tokens=8,
        limit=1,
        tasks=1,
        prompts_file=_prompt_file(tmp_path),
        dtype="float32",
        out=str(tmp_path / "out"),
    )
    result = run_compare(config, target=target, draft=draft, progress=False)
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {
        "compare.json",
        "report.md",
        "results.jsonl",
        "quality_vs_speed.png",
    }
    saved = json.loads((out / "compare.json").read_text())
    assert saved["rows"] == result["rows"]
    rows = {(r["variant"], r["speculative"], r["temperature"]): r for r in saved["rows"]}
    assert set(rows) == {
        ("fp32", False, 0.0),
        ("fp32", True, 0.0),
        ("drop-layers=1", False, 0.0),
        ("drop-layers=1", True, 0.0),
        ("prune-mlp=0.25", False, 0.0),
        ("prune-mlp=0.25", True, 0.0),
        ("fp32", False, 0.7),
        ("fp32", True, 0.7),
    }
    for row in saved["rows"]:
        assert set(row) >= ROW_KEYS
        assert row["lossless_to"] == row["variant"]
        # a measured ratio: its value belongs to benchmarks; here only that it is one
        assert isinstance(row["decode_speedup"], float) and math.isfinite(row["decode_speedup"])
        assert row["memory_bytes"] > 0
        if row["speculative"] and not row["temperature"]:
            # greedy speculation gives its own target's tokens, exactly (float32)
            assert row["identical"] == row["compared"] == 2
    reference = rows["fp32", False, 0.0]
    assert reference["kld_mean"] == 0.0 and reference["top1_agreement"] == 1.0
    assert reference["decode_speedup"] == pytest.approx(1.0)
    assert (
        reference["task_pass_rate"] is not None
        and rows["fp32", True, 0.7]["task_pass_rate"] is None
    )
    dropped = rows["drop-layers=1", False, 0.0]
    assert dropped["layers"] == 2 and dropped["params"] < reference["params"]
    assert (
        dropped["kld_mean"] > 0
        and dropped["kld_mean"] == rows["drop-layers=1", True, 0.0]["kld_mean"]
    )
    assert rows["prune-mlp=0.25", False, 0.0]["intermediate_size"] == 48
    # the calibration prompts (the last of each category) are never scored
    assert saved["calibration"]["prompts"] == ["w2", "q2"]
    assert {r["prompt_id"] for r in map(json.loads, (out / "results.jsonl").open())} == {"w1", "q1"}
    report = (out / "report.md").read_text()
    assert "the bfloat16 reference is itself the GGUF" in report and "real" in report
    assert list((tmp_path / "cache" / "calibration").glob("target-*.json"))


@needs_kernel()
def test_quantized_variants_run_on_the_kernels_and_differ_from_the_reference(tmp_path):
    target, draft = _tiny_pair(torch.bfloat16)
    before = _logits(target.model, [5, 6, 7])
    int8 = quantized_target(target, 8)
    int4, _ = make_variant(target, Variant("int4"))
    assert int8.kernel.startswith("int8") and int4.kernel.startswith("int4")
    assert torch.equal(_logits(target.model, [5, 6, 7]), before)  # the reference untouched
    texts = [("a", [5, 6, 7], [8, 9, 10, 11])]
    quality = measure_quality(target.model, {"int8": int8.model, "int4": int4.model}, texts, False)
    assert 0 < quality["int8"]["all"]["kld_mean"] < quality["int4"]["all"]["kld_mean"]
    config = CompareConfig(
        target="target",
        draft="draft",
        variants=["int8"],
        ks=[2],
        max_new_tokens=6,
        limit=1,
        tasks=0,
        sample_temperature=0.0,
        prompts_file=_prompt_file(tmp_path),
        out=str(tmp_path / "out"),
    )
    rows = run_compare(config, target=target, draft=draft, progress=False)["rows"]
    spec = next(r for r in rows if r["variant"] == "int8" and r["speculative"])
    assert spec["lossless_to"] == "int8" and spec["kld_mean"] > 0
    assert [r["variant"] for r in rows] == ["bf16", "bf16", "int8", "int8"]


def test_calibration_text_is_cached_with_the_model(tmp_path, monkeypatch):
    target, _ = _tiny_pair()
    prompts = [BenchPrompt("p1", "qa", ["why?"]), BenchPrompt("p2", "qa", ["how?"])]
    first = calibration_sequences(target, prompts, 5, cache=tmp_path, progress=False)
    assert len(first) == 2 and all(len(s) > 5 for s in first)
    assert len(list(tmp_path.glob("target-*.json"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("the cached text should have been read")

    monkeypatch.setattr(SpeculativeDecoder, "generate", fail)
    assert calibration_sequences(target, prompts, 5, cache=tmp_path, progress=False) == first
    with pytest.raises(AssertionError):  # other settings: another key
        calibration_sequences(target, prompts, 6, cache=tmp_path, progress=False)


def test_split_prompts_keeps_the_calibration_prompts_out():
    prompts = [BenchPrompt(f"{c}{i}", c, ["x"]) for c in "ab" for i in range(4)] + [
        BenchPrompt("c0", "c", ["x"])
    ]
    scored, calib = split_prompts(prompts, 2, limit=1)
    assert [p.id for p in scored] == ["a0", "b0", "c0"]  # a lone prompt stays scored
    assert [p.id for p in calib] == ["a2", "a3", "b2", "b3"]


# -- bad input ----------------------------------------------------------------------------------


def test_bad_variants_name_what_is_allowed():
    assert parse_variants(["int8", "drop-layers=4", "prune-mlp=0.25"]) == [
        Variant("int8"),
        Variant("drop-layers", 4),
        Variant("prune-mlp", 0.25),
    ]
    for text, message in [
        ("int3", "unknown variant 'int3': choose from int8, int4"),
        ("drop-layers", "unknown variant"),
        ("drop-layers=0", "whole number N >= 1"),
        ("drop-layers=2.5", "whole number N >= 1"),
        ("prune-mlp=0", r"fraction in \(0, 1\)"),
        ("prune-mlp=1", r"fraction in \(0, 1\)"),
        ("prune-mlp=abc", r"fraction in \(0, 1\)"),
        ("prune-mlp=nan", r"fraction in \(0, 1\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            Variant.parse(text)
    with pytest.raises(ValueError, match="--tree needs a model draft"):
        CompareConfig("t", "ngram", variants=[], trees=["static:2,1"]).validate()
    with pytest.raises(ValueError, match="given twice"):
        parse_variants(["int4", "int4"])
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        check_variants([Variant("int8")], torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        quantized_target(LoadedModel(tiny_llama(0), None, "tiny"), 4)  # float32: never silent
    tiny = LoadedModel(tiny_llama(0, layers=2), None, "tiny")
    with pytest.raises(ValueError, match="has 2 decoder layers; drop between 1 and 1"):
        check_fits(Variant("drop-layers", 2), tiny)
    with pytest.raises(ValueError, match="Llama-style decoder"):
        check_fits(Variant("prune-mlp", 0.5), LoadedModel(tiny_gpt2(0), None, "gpt2"))


def test_compare_cli_bad_input_is_one_line_exit_2(tiny_folders, tmp_path, capsys):
    base = ["compare", "--target", str(tiny_folders / "target"), "--draft"]
    base += [str(tiny_folders / "draft"), "--out", str(tmp_path / "out"), "--dtype", "float32"]
    cases = [
        (["--variants", "int3"], "unknown variant 'int3'"),
        (["--variants", "prune-mlp=1.5"], "fraction in (0, 1)"),
        (["--variants", "int8"], "use --dtype bfloat16 on the CPU"),
        (["--variants", "drop-layers=2"], "has 2 decoder layers"),  # the tiny target has 2
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert len([line for line in err.splitlines() if "error" in line]) == 1, err
