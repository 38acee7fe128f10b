"""The one `--draft` parser (core/draft_spec.py): its forms, round trip and errors, and that every
place that reads a draft (resolve_draft, the run config, the vLLM export, bench, tune, the
command line) takes and refuses what it did before, before any model is loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from specdecode.bench.runner import BenchConfig
from specdecode.bench.tune import run_tune
from specdecode.cli import main
from specdecode.config import RunConfig, to_vllm_speculative_config
from specdecode.core.draft_spec import DRAFT_FORMS, MODEL_FORMS, DraftSpec, ModelSpec
from specdecode.drafters import NgramDrafter, resolve_draft

SRC = Path(__file__).resolve().parents[1] / "src" / "specdecode"


@pytest.mark.parametrize(
    "text, expected, canonical",
    [
        ("qwen2.5-coder-0.5b", DraftSpec("model", ModelSpec("qwen2.5-coder-0.5b")), None),
        ("org/m:int8", DraftSpec("model", ModelSpec("org/m", "int8")), None),
        ("./folder:int4", DraftSpec("model", ModelSpec("./folder", "int4")), None),
        ("/models/a:b", DraftSpec("model", ModelSpec("/models/a:b")), None),  # a colon in a path
        ("ngram-model", DraftSpec("model", ModelSpec("ngram-model")), None),  # no colon: a name
        ("ngram", DraftSpec("ngram", ngram=(1, 3)), "ngram:1-3"),
        ("ngram:2-5", DraftSpec("ngram", ngram=(2, 5)), None),
        ("ngram:02-5", DraftSpec("ngram", ngram=(2, 5)), "ngram:2-5"),
        ("ngram:4-4", DraftSpec("ngram", ngram=(4, 4)), None),
        ("early-exit:8", DraftSpec("early-exit", depth=8), None),
        ("distilled:runs/d", DraftSpec("distilled", ModelSpec("runs/d")), None),
        ("distilled:runs/d:int4", DraftSpec("distilled", ModelSpec("runs/d", "int4")), None),
        ("distilled-model", DraftSpec("model", ModelSpec("distilled-model")), None),
    ],
)  # fmt: skip
def test_every_form_parses_and_prints_canonically(text, expected, canonical):
    spec = DraftSpec.parse(text)
    assert spec == expected
    assert str(spec) == (canonical or text)
    assert DraftSpec.parse(str(spec)) == spec


def test_what_trees_and_confidence_need():
    assert DraftSpec.parse("m").is_model_draft and DraftSpec.parse("m:int4").is_model_draft
    assert DraftSpec.parse("early-exit:3").is_model_draft  # shares the target's weights
    assert not DraftSpec.parse("ngram:1-2").is_model_draft
    assert DraftSpec.parse("m:int8").model.bits == 8 and DraftSpec.parse("m").model.bits is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no model name"),
        (":int8", "quantizes a draft model"),
        (":int4", "quantizes a draft model"),
        ("ngram:int8", "quantizes a draft model"),
        ("ngram:1-3:int8", "quantizes a draft model"),
        ("early-exit:2:int4", "quantizes a draft model"),
        ("ngram:", "ngram:MIN-MAX"),
        ("ngram:3", "ngram:MIN-MAX"),
        ("ngram:a-b", "ngram:MIN-MAX"),
        ("ngram:1-", "ngram:MIN-MAX"),
        ("ngram:-3", "ngram:MIN-MAX"),
        ("ngram:1-2-3", "ngram:MIN-MAX"),
        ("ngram: 1-3", "ngram:MIN-MAX"),
        ("ngram:²-3", "ngram:MIN-MAX"),  # a digit to str.isdigit, not to int()
        ("ngram:4-2", "1 <= min <= max"),
        ("ngram:0-2", "1 <= min <= max"),
        ("early-exit", "needs a depth"),
        ("early-exit:", "needs a depth"),
        ("early-exit:x", "needs a depth"),
        ("early-exit:-1", "needs a depth"),
        ("early-exit8", "needs a depth"),  # a missing colon, not a model named so
        ("early-exit:0", "needs a depth >= 1"),
        ("m:int2", "unknown quantization 'int2'"),
        ("m:INT8", "unknown quantization 'INT8'"),
        ("m:q4_0", "unknown quantization 'q4_0'"),
        ("m:int8:int8", "one quantization at most"),
    ],
)
def test_every_malformed_draft_names_the_allowed_forms(text, message):
    with pytest.raises(ValueError, match="bad draft") as err:
        DraftSpec.parse(text)
    assert message in str(err.value) and DRAFT_FORMS in str(err.value)


def test_a_spec_built_by_hand_is_checked_as_parsing_is():
    for fields, message in [
        (dict(kind="lookup", ngram=(1, 3)), "bad draft kind"),
        (dict(kind="ngram"), "sets ngram alone"),
        (dict(kind="ngram", ngram=(1, 3), depth=2), "sets ngram alone"),
        (dict(kind="model", model=ModelSpec("m"), ngram=(1, 3)), "sets model alone"),
        (dict(kind="ngram", ngram=(3, 1)), "1 <= min <= max"),
        (dict(kind="early-exit", depth=0), "needs a depth >= 1"),
        (dict(kind="model", model=ModelSpec("ngram")), "reads as ngram"),  # would not read back
    ]:
        with pytest.raises(ValueError, match=message):
            DraftSpec(**fields)


def test_model_spec_is_the_model_part_alone():
    assert ModelSpec.parse("org/m:int4") == ModelSpec("org/m", "int4")
    assert str(ModelSpec("org/m", "int8")) == "org/m:int8" and str(ModelSpec("m")) == "m"
    with pytest.raises(ValueError, match="bad target 'm:fp8': unknown quantization") as err:
        ModelSpec.parse("m:fp8", what="target")
    assert MODEL_FORMS in str(err.value)
    for name, quantization, message in [
        ("", None, "no model name"),
        ("m:int8", None, "one quantization at most"),
        ("m", "int3", "bad model quantization"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelSpec(name, quantization)


# -- properties over generated specs --------------------------------------------------------

_names = st.text(st.characters(codec="ascii", exclude_characters=":"), min_size=1, max_size=12)
_names = _names.filter(
    lambda name: not name.startswith(("ngram", "early-exit")) and name != "distilled"
)
_specs = st.one_of(
    st.builds(
        lambda name, q: DraftSpec("model", ModelSpec(name, q)),
        _names,
        st.sampled_from([None, "int8", "int4"]),
    ),
    st.builds(
        lambda low, extra: DraftSpec("ngram", ngram=(low, low + extra)),
        st.integers(1, 50),
        st.integers(0, 50),
    ),
    st.builds(lambda depth: DraftSpec("early-exit", depth=depth), st.integers(1, 200)),
    st.builds(
        lambda name, q: DraftSpec("distilled", model=ModelSpec(name, q)),
        _names,
        st.sampled_from([None, "int8", "int4"]),
    ),
)


@given(_specs)
def test_round_trip(spec):
    assert DraftSpec.parse(str(spec)) == spec


@given(
    st.text(max_size=24) | st.from_regex(r"(ngram|early-exit|distilled|m)(:[0-9a-z\-]{0,6}){0,3}")
)
@example("early-exit:00")  # the error quotes the text as typed, not the spec it would print as
@example("ngram:02-1")
def test_any_text_parses_canonically_or_is_refused_with_the_forms(text):
    try:
        spec = DraftSpec.parse(text)
    except ValueError as err:
        assert str(err).startswith(f"bad draft {text!r}: ") and DRAFT_FORMS in str(err)
    else:
        assert DraftSpec.parse(str(spec)) == spec


def test_the_parser_module_imports_no_torch():
    # loaded as a file, without the package (whose __init__ imports the engine)
    path = str(SRC / "core" / "draft_spec.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('draft_spec', {path!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['draft_spec'] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(module.DraftSpec.parse('ngram'))\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ngram:1-3"


# -- the former callers ---------------------------------------------------------------------


def test_resolve_draft_takes_the_text_or_the_spec():
    assert resolve_draft(None, None) is None
    for spec in ("ngram:2-4", DraftSpec("ngram", ngram=(2, 4))):
        drafter = resolve_draft(spec, None)
        assert isinstance(drafter, NgramDrafter) and drafter.name == "ngram:2-4"
    with pytest.raises(ValueError, match="quantizes a draft model"):
        resolve_draft("ngram:int8", None)


def test_the_run_config_checks_its_drafts_on_construction():
    assert RunConfig(draft="ngram").draft_spec == DraftSpec("ngram", ngram=(1, 3))
    assert RunConfig().draft_spec is None
    with pytest.raises(ValueError, match="bad draft 'ngram:x'"):
        RunConfig(draft="ngram:x")
    with pytest.raises(ValueError, match=r"per_category\['qa'\]\.bad draft 'early-exit'"):
        RunConfig(draft="m", per_category={"qa": {"draft": "early-exit"}})
    # a tree or --confidence needs a model or early exit, never an n-gram draft
    RunConfig(draft="early-exit:2", tree="static:2,1")
    RunConfig(draft="m:int4", tree="static:2,1")
    RunConfig(draft="eagle3:runs/e", tree="dynamic:8")  # a head grows trees too
    for draft in ("ngram", "ngram:2-3"):
        with pytest.raises(ValueError, match="tree needs a model draft"):
            RunConfig(draft=draft, tree="static:2,1")


def test_the_vllm_export_reads_the_spec():
    int4 = to_vllm_speculative_config(RunConfig(draft="org/m:int4", k=2))
    assert int4 == {"method": "draft_model", "model": "org/m", "num_speculative_tokens": 2}
    assert to_vllm_speculative_config(RunConfig(draft="ngram:2-2"))["prompt_lookup_max"] == 2
    with pytest.raises(ValueError, match="a distilled draft is an adapter merged at load time"):
        to_vllm_speculative_config(RunConfig(draft="distilled:runs/d"))
    head = to_vllm_speculative_config(RunConfig(draft="eagle3:runs/e:int4", k=3))
    assert head == {"method": "eagle3", "model": "runs/e", "num_speculative_tokens": 3}


def test_bench_and_tune_refuse_a_bad_draft_before_loading():
    with pytest.raises(ValueError, match="bad draft 'ngram:x'"):
        BenchConfig(target="no-such-model", drafts=["ngram:x"]).validate()
    only_ngram = BenchConfig(
        target="no-such-model", drafts=["ngram", "ngram:2-4"], trees=["static:2"]
    )
    with pytest.raises(ValueError, match="--tree needs a model draft among the candidates"):
        run_tune(only_ngram, k_max=2, progress=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt-ids", "1", "--draft", "ngram:3"], "ngram:MIN-MAX"),
        (["generate", "--prompt-ids", "1", "--draft", "early-exit"], "needs a depth"),
        (["generate", "--prompt-ids", "1", "--draft", "ngram:int8"], "quantizes a draft model"),
        (["serve", "--draft", "m:int3"], "unknown quantization"),
        (["generate", "--prompt-ids", "1", "--draft", "ngram", "--confidence", "0.5"], "model"),
        (["bench", "--draft", "ngram:4-2"], "1 <= min <= max"),
        (["tune", "--draft", "early-exit:0"], "needs a depth >= 1"),
    ],
)  # fmt: skip
def test_the_command_line_refuses_a_bad_draft_before_loading(capsys, argv, message):
    # the target does not exist: reaching load_model would fail with another message
    assert main([*argv, "--target", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
