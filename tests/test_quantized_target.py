"""`MODEL:int8` / `MODEL:int4` targets: speculation reproduces the quantized target alone (chain
and tree), the target's bfloat16 weights are freed but for a tied output layer, what cannot run
is an error before anything loads, and every command takes the suffix."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specdecode import SpeculativeDecoder, load_model
from specdecode.bench.memory import weights_bytes
from specdecode.cli import build_parser, main
from specdecode.cli_args import run_config_from_args
from specdecode.drafters import resolve_draft
from specdecode.kernels import apply_kernel, quantize_linears, restore_linears
from specdecode.kernels import build as kernel_build
from specdecode.kernels.quantize import int4_weights, weight_freed

from conftest import needs_kernel, noisy_copy, tiny_gpt2, tiny_llama, tiny_qwen2

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A tiny bfloat16 target and a noisy draft of it, saved, per architecture."""
    root = tmp_path_factory.mktemp("quantized-targets")
    folders = {}
    for name, factory in (("llama", tiny_llama), ("qwen2", tiny_qwen2)):
        target = factory(seed=0).to(torch.bfloat16)
        target.save_pretrained(root / name / "target")
        noisy_copy(target, 0.05).to(torch.bfloat16).save_pretrained(root / name / "draft")
        folders[name] = root / name
    return folders


@needs_kernel()
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_speculation_over_a_quantized_target_is_that_target_alone(pairs, arch, bits):
    folder = pairs[arch]
    target = load_model(f"{folder / 'target'}:{bits}", role="target")
    assert target.name == f"target:{bits}" and target.kernel.startswith(bits)
    draft = resolve_draft(f"{folder / 'draft'}:int4", target)
    expected = SpeculativeDecoder(target).generate(PROMPT, max_new_tokens=40).token_ids
    plain = SpeculativeDecoder(load_model(folder / "target")).generate(PROMPT, max_new_tokens=40)
    assert plain.token_ids != expected  # a different model: its own output is the reference
    for kwargs in ({"k": 1}, {"k": 4}, {"tree": "dynamic:6"}, {"tree": "static:2,1"}):
        result = SpeculativeDecoder(target, draft, k_policy="fixed", **kwargs).generate(
            PROMPT, max_new_tokens=40
        )
        # batch invariant kernels on a short prompt: exact (a bfloat16 near-tie is the only
        # allowed difference, invariant 1; none here)
        assert result.token_ids == expected, kwargs
        assert result.stats.drafted > 0, kwargs
    early_exit = resolve_draft("early-exit:1", target)  # the quantized target's first layer
    result = SpeculativeDecoder(target, early_exit, k=2, k_policy="fixed").generate(
        PROMPT, max_new_tokens=40
    )
    assert result.token_ids == expected


@needs_kernel()
def test_a_target_frees_its_bfloat16_weights_and_computes_the_same(tmp_path):
    model = tiny_llama(seed=3, tie_word_embeddings=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "tied")
    kept = load_model(f"{tmp_path / 'tied'}:int4", keep_weights=True)  # a draft in training
    freed = load_model(f"{tmp_path / 'tied'}:int4")  # as a target
    assert weights_bytes(freed.model) < 0.6 * weights_bytes(kept.model)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(freed.model(ids).logits, kept.model(ids).logits)
    # the tied output layer (int8) keeps the embedding's weight, every other linear is freed
    model = freed.model
    assert not weight_freed(model.lm_head)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(weight_freed(m) for m in linears) == len(linears) - 1
    assert freed.device.type == "cpu" and freed.dtype == torch.bfloat16
    # nothing to restore from: a clear error, and the model is left as it was
    with pytest.raises(ValueError, match="cannot restore the bfloat16 linears"):
        apply_kernel(model, "off")
    with pytest.raises(ValueError, match="load the model again without the suffix"):
        restore_linears(model)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, kept.model(ids).logits)
    assert quantize_linears(model, bits=4, keep_weights=False) == len(linears)  # idempotent


@needs_kernel()
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize("suffix", [":int4", ":int8"])
def test_a_quantized_model_lets_go_of_its_weights_file(tmp_path, suffix):
    # transformers maps the safetensors file: a view of it left alive (the embedding) would
    # keep every page of it read or written in the process (models/loading.py `own_memory`)
    from transformers import AutoModelForCausalLM

    tiny_llama(seed=3, tie_word_embeddings=True).to(torch.bfloat16).save_pretrained(tmp_path)
    raw = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert str(tmp_path) in Path("/proc/self/maps").read_text()  # what the check looks for
    del raw
    gc.collect()
    loaded = load_model(f"{tmp_path}{suffix}")
    assert str(tmp_path) not in Path("/proc/self/maps").read_text()
    model = loaded.model
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([PROMPT])).logits).all()


@needs_kernel()
def test_a_drafts_tied_output_layer_takes_4_bits_a_targets_keeps_int8(tmp_path):
    model = tiny_llama(seed=3, tie_word_embeddings=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "tied")
    target = load_model(f"{tmp_path / 'tied'}:int4", role="target")
    draft = resolve_draft(f"{tmp_path / 'tied'}:int4", target)
    assert hasattr(draft.model.lm_head, "_specdecode_q4")
    assert hasattr(target.model.lm_head, "_specdecode_qweight")
    for loaded in (draft, target):  # the embedding still reads the bfloat16 weight
        head, embed = loaded.model.lm_head, loaded.model.get_input_embeddings()
        assert head.weight is embed.weight and not weight_freed(head)
        # every other linear's bfloat16 weight is freed, the draft's as the target's
        others = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
        assert sum(weight_freed(m) for m in others) == len(others) - 1
    with torch.inference_mode():
        logits = draft.model(torch.tensor([PROMPT])).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="tied_bits must be 4 or 8"):
        quantize_linears(tiny_llama(seed=1).to(torch.bfloat16), bits=4, tied_bits=2)


@needs_kernel()
@pytest.mark.parametrize("role, kept", [("target", True), ("model", True), ("draft", False)])
def test_only_a_targets_int4_keeps_its_presets_gguf(role, kept, monkeypatch):
    """A target's `:int4` reads the preset GGUF's own codes, so its fetch keeps the file; a
    draft's is re-quantized to 4 bits everywhere and reads none: keeping it would only take disk."""
    from specdecode.models import loading

    asked = []

    class Fetched(Exception):
        pass

    def fetch(name, on_gguf=None):
        asked.append(on_gguf is not None)
        raise Fetched

    monkeypatch.setattr(loading, "fetch_preset", fetch)
    with pytest.raises(Fetched):
        load_model("smollm2-135m-instruct:int4", role=role)
    assert asked == [kept]


@needs_kernel()
def test_a_freed_layer_still_falls_back_to_pytorch():
    layer = torch.nn.Linear(64, 24).to(torch.bfloat16)
    quantize_linears(layer, bits=4, keep_weights=False)
    assert weight_freed(layer) and layer.weight.shape == (24, 64)
    x = torch.randn(3, 64).bfloat16().requires_grad_()  # autograd: PyTorch on the 4-bit weights
    out = layer(x)
    expected = F.linear(x.detach(), int4_weights(layer).bfloat16(), layer.bias.detach())
    assert torch.equal(out.detach(), expected)
    with torch.no_grad():  # the kernel, on 8-bit activations
        torch.testing.assert_close(layer(x).float(), expected.float(), rtol=2**-7, atol=2e-2)
    out.float().sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(dtype="float32"), "the dtype is float32: use --dtype bfloat16"),
        (dict(device="mps"), "the device is mps: use --device cpu"),
        (dict(kernel="off"), "the kernel is off (--kernel off or $SPECDECODE_KERNEL=off): use"),
    ],
)
@pytest.mark.parametrize("role", ["target", "draft"])
def test_what_cannot_run_fails_before_loading(options, says, role, monkeypatch):
    # the model does not exist: the settings are refused before anything would load it
    options = {"dtype": "bfloat16", "device": "cpu", **options}
    if "kernel" in options:  # what --kernel sets for every model of a command (cli.main)
        monkeypatch.setenv("SPECDECODE_KERNEL", options.pop("kernel"))
    with pytest.raises(ValueError) as err:
        if role == "target":
            load_model("no-such-model:int4", role="target", **options)
        else:
            resolve_draft("no-such-model:int4", None, options["dtype"], options["device"])
    message = str(err.value)
    assert message.startswith(f"no-such-model:int4: int4 {role}s run on the CPU kernel")
    assert says in message and "or drop the :int4 suffix" in message


def test_a_cpu_without_the_kernel_is_an_error(monkeypatch):
    monkeypatch.setattr(kernel_build, "unavailable_reason", lambda: "the CPU has no AVX2")
    for load in (
        lambda: load_model("no-such-model:int8", device="cpu", role="target"),
        lambda: resolve_draft("no-such-model:int8", None, device="cpu"),
    ):
        with pytest.raises(ValueError, match="the CPU has no AVX2: the CPU kernels need a CPU "):
            load()


@needs_kernel()
def test_a_model_without_nn_linear_layers_is_refused(tmp_path):
    tiny_gpt2(seed=0).save_pretrained(tmp_path / "gpt2")  # transformers' Conv1D layers
    with pytest.raises(ValueError, match=r"of the target's weights are in nn\.Linear layers"):
        load_model(f"{tmp_path / 'gpt2'}:int4", role="target")


def test_unknown_suffixes_are_the_model_spec_errors():
    with pytest.raises(ValueError, match="bad target 'm:int2': unknown quantization 'int2'"):
        load_model("m:int2", role="target")
    with pytest.raises(ValueError, match="bad model 'm:int4:int8': one quantization at most"):
        load_model("m:int4:int8")


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_commands_take_a_quantized_target(command):
    argv = [command, "--target", "qwen2.5-coder-1.5b-instruct:int4", "--draft", "d:int4"]
    argv += ["--prompt", "hi"] if command == "generate" else []
    run = run_config_from_args(build_parser().parse_args(argv))
    assert run.target == "qwen2.5-coder-1.5b-instruct:int4" and run.draft == "d:int4"
    bad = [a if a != "qwen2.5-coder-1.5b-instruct:int4" else "m:q4_0" for a in argv]
    with pytest.raises(ValueError, match="bad target 'm:q4_0': unknown quantization 'q4_0'"):
        run_config_from_args(build_parser().parse_args(bad))


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--dtype", "float32"],
        ["bench", "--methods", "ar", "--dtype", "float32", "--limit", "1"],
        ["demo", "--dtype", "float32", "--limit", "1"],
    ],
)
def test_a_quantized_target_that_cannot_run_exits_with_the_alternatives(argv, capsys):
    # refused before anything is loaded: the model does not exist
    assert main([*argv, "--target", "no-such-model:int4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model:int4: int4 targets run on the CPU kernel" in err
    assert "use --dtype bfloat16, or drop the :int4 suffix" in err


@needs_kernel()
def test_bench_names_the_quantized_target_as_the_reference(tiny_folders, tmp_path):
    out = tmp_path / "run"
    target = f"{tiny_folders / 'target'}:int4"
    argv = ["bench", "--target", target, "--draft", f"{tiny_folders / 'draft'}:int4"]
    argv += ["--methods", "ar,spec,hf-ar,hf-assisted", "--k", "2", "--max-new-tokens", "8"]
    argv += ["--limit", "1"]
    argv += ["--prompts", str(tiny_folders / "prompts.jsonl"), "--dtype", "bfloat16"]
    assert main([*argv, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["target"] for r in records} == {target}
    # Hugging Face's generate runs over the freed weights too (through the modules' forwards)
    assert {r["method"] for r in records} == {"ar", "spec", "hf-ar", "hf-assisted"}
    spec = [r for r in records if r["method"] == "spec"]
    assert spec and all(r["identical_to_ar"] for r in spec)  # the int4 target's own output
    report = (out / "report.md").read_text()
    assert f"Target `{target}` (4-bit weights: `ar` and the identity checks are this" in report
    assert json.loads((out / "run.json").read_text())["kernel"].startswith("int4")


def test_own_memory_copies_each_parameter_but_keeps_a_shared_storage_shared():
    from specdecode.models.loading import own_memory

    model = tiny_llama(seed=3, tie_word_embeddings=True)
    embedding = model.get_input_embeddings().weight
    norm = model.model.norm.weight
    model.register_buffer("rows", embedding[:4], persistent=False)  # a second view of it
    expected = {name: t.clone() for name, t in model.state_dict().items()}
    norm_at = norm.untyped_storage().data_ptr()
    own_memory(model)
    assert norm.untyped_storage().data_ptr() != norm_at  # its own copy now
    assert model.rows.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    assert model.lm_head.weight is embedding  # still tied
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name
