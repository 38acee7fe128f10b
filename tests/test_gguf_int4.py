"""`:int4` of a GGUF-made model runs on the file's own 4-bit codes (models/gguf_int4.py): the
decoding equals gguf-py's on random Q4_K / Q4_1 / Q4_0 / Q6_K blocks, a tiny Qwen2 / Llama model
made from a GGUF computes with exactly codes * scale + low (llama.cpp's q / k row permutation
undone) and its Q6_K linears with exactly the file's 6-bit weights, its linears of other types run
on int8, and greedy speculation over it is that target alone."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from specdecode import SpeculativeDecoder
from specdecode.core.draft_spec import ModelSpec
from specdecode.kernels import apply_kernel
from specdecode.kernels.quantize import int4_weights, int8_weights, is_quantized, q6_weights
from specdecode.models import fetch, presets
from specdecode.models.gguf_int4 import (
    LEFT_OUT,
    codes_file,
    decode_float,
    decode_int4,
    decode_q6,
    gguf_codes,
    preset_gguf,
    write_codes,
)
from specdecode.models.loading import LoadedModel
from specdecode.models.quantized import quantize_loaded

from conftest import _llama_like, needs_kernel, noisy_copy

T = GGMLQuantizationType
BLOCK_BYTES = {T.Q4_K: 144, T.Q4_1: 20, T.Q4_0: 18, T.Q6_K: 210}
BLOCK_WEIGHTS = {T.Q4_K: 256, T.Q4_1: 32, T.Q4_0: 32, T.Q6_K: 256}


def random_blocks(qtype: T, rows: int, k: int, seed: int) -> np.ndarray:
    """Rows [rows, bytes] of random blocks of `qtype`: random codes and 6-bit scales, float16
    d (and dmin / m) drawn positive and small enough that nothing overflows."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * k // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]), np.uint8)
    if qtype == T.Q6_K:  # codes and int8 scales random, d (the last two bytes) float16 > 0
        d = rng.uniform(1e-6, 2e-5, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, 208:] = d.view(np.uint8)
        return blocks.reshape(rows, -1)
    halves = 2 if qtype in (T.Q4_K, T.Q4_1) else 1  # d, then dmin (Q4_K) or m (Q4_1)
    scales = rng.uniform(1e-4, 2e-3, (blocks.shape[0], halves)).astype(np.float16)
    if qtype == T.Q4_1:
        scales[:, 1] *= rng.choice([-1, 1], blocks.shape[0]).astype(np.float16) * 8
    blocks[:, : 2 * halves] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, T]]) -> None:
    writer = GGUFWriter(path, arch)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_q6_k_decoding_is_exactly_gguf_dequantize(tmp_path):
    raw = random_blocks(T.Q6_K, rows=6, k=512, seed=1)
    write_gguf(tmp_path / "r.gguf", "qwen2", {"blk.0.ffn_down.weight": (raw, T.Q6_K)})
    tensor = GGUFReader(tmp_path / "r.gguf").tensors[0]
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).float()  # [6, 512]
    q, sc, d = decode_q6(tensor.data)
    assert q.dtype == torch.uint8 and int(q.max()) <= 63 and sc.dtype == torch.int8
    assert sc.shape == (6, 32) and d.shape == (6, 2) and d.dtype == torch.float16
    scale = sc.float().repeat_interleave(16, 1) * d.float().repeat_interleave(256, 1)
    assert torch.equal(scale * (q.float() - 32), expected)


def test_our_reader_reads_what_gguf_py_reads_and_hands_back_only_the_files_pages(tmp_path):
    from specdecode.models.gguf_int4 import _file_backed, open_gguf

    raw = random_blocks(T.Q4_K, rows=6, k=512, seed=2)
    write_gguf(tmp_path / "r.gguf", "qwen2", {"blk.0.ffn_up.weight": (raw, T.Q4_K)})
    ours, theirs = open_gguf(tmp_path / "r.gguf"), GGUFReader(tmp_path / "r.gguf")
    assert ours.fields["general.architecture"].contents() == "qwen2"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    mine, reference = ours.tensors[0].data, theirs.tensors[0].data
    assert type(mine) is np.ndarray and np.array_equal(mine, reference)
    assert _file_backed(mine) and _file_backed(reference)
    assert not _file_backed(mine.copy()) and not _file_backed(mine[[0, 2]])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_1, T.Q4_0])
def test_decoding_equals_gguf_dequantize(tmp_path, qtype):
    raw = random_blocks(qtype, rows=6, k=512, seed=int(qtype))
    write_gguf(tmp_path / "r.gguf", "qwen2", {"blk.0.ffn_up.weight": (raw, qtype)})
    tensor = GGUFReader(tmp_path / "r.gguf").tensors[0]
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).float()  # [6, 512]
    assert expected.shape == (6, 512)
    assert torch.equal(decode_float(tensor.data, qtype.name), expected)
    q, sc, ml, d, dl = decode_int4(tensor.data, qtype.name)
    assert q.dtype == sc.dtype == torch.uint8 and ml.dtype == torch.int8
    assert int(q.max()) <= 15 and sc.shape == ml.shape == (6, 16)
    # Q4_K: the file's 6-bit codes under its d and -dmin per 256 k; Q4_0 / Q4_1: a step per group
    assert d.shape == dl.shape == ((6, 2) if qtype == T.Q4_K else (6, 16))
    assert d.dtype == dl.dtype == torch.float16
    assert torch.equal(_weights(q, sc, ml, d, dl), expected)  # the file's weights exactly


def _weights(q, sc, ml, d, dl) -> torch.Tensor:
    """Int4 codes -> weights [N, K] float32: q (d sc) + dl ml per group (exact products)."""
    n, k = q.shape
    g = k // 32
    repeat = g // d.shape[1]
    scale = sc.float() * d.float().repeat_interleave(repeat, 1)
    low = ml.float() * dl.float().repeat_interleave(repeat, 1)
    return (q.float().reshape(n, g, 32) * scale[..., None] + low[..., None]).reshape(n, k)


def _model(arch: str, seed: int = 0):
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    # K a multiple of Q4_K's 256; 8 query heads over 2 kv heads: the permutation matters
    return _llama_like(
        config_cls, model_cls, seed, 96, 1, hidden_size=256, intermediate_size=512,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip


# GGUF name -> (HF module, type): 4-bit ones from random blocks, others gguf-py quantizes
LAYOUT = {
    "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj", T.Q4_K),
    "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj", T.Q4_1),
    "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj", T.Q8_0),
    "blk.0.attn_output.weight": ("model.layers.0.self_attn.o_proj", T.Q4_0),
    "blk.0.ffn_gate.weight": ("model.layers.0.mlp.gate_proj", T.Q4_K),
    "blk.0.ffn_up.weight": ("model.layers.0.mlp.up_proj", T.Q4_K),
    "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj", T.Q6_K),
    "output.weight": ("lm_head", T.Q4_K),
}
LAYOUT_TYPES = {hf: qtype for hf, qtype in LAYOUT.values()}


def gguf_made(tmp_path, arch: str):
    """A tiny bfloat16 model whose linears hold a GGUF file's values (as transformers' loader
    gives them: llama q / k rows un-permuted), the file, and each module's expected float32
    weights from the file's codes (its 4-bit and 6-bit ones: its values, un-permuted too)."""
    model = _model(arch)
    modules = dict(model.named_modules())
    processor = LlamaTensorProcessor(config=model.config.to_dict())
    tensors, expected = {}, {}
    for i, (name, (hf, qtype)) in enumerate(LAYOUT.items()):
        n, k = modules[hf].weight.shape
        if qtype in BLOCK_BYTES:
            raw = random_blocks(qtype, n, k, seed=i)
        else:
            raw = quantize(modules[hf].weight.detach().float().numpy(), qtype)
        tensors[name] = (raw, qtype)
        values = dequantize(raw, qtype)  # [N, K] in the file's row order
        # the 6-bit and 4-bit panels hold the file's weights exactly
        codes = values if qtype == T.Q6_K or qtype in BLOCK_BYTES else None
        if arch == "llama":  # transformers' own reverse permutation
            values = processor.process(values, name).weights
            codes = processor.process(codes, name).weights if codes is not None else None
        with torch.no_grad():
            modules[hf].weight.copy_(torch.from_numpy(np.ascontiguousarray(values)))
        if codes is not None:
            expected[hf] = torch.from_numpy(np.ascontiguousarray(codes))
    write_gguf(tmp_path / f"{arch}.gguf", arch, tensors)
    return model.to(torch.bfloat16), tmp_path / f"{arch}.gguf", expected


@needs_kernel()
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_of_a_gguf_model_computes_with_the_files_codes(tmp_path, arch):
    model, path, expected = gguf_made(tmp_path, arch)
    draft = LoadedModel(noisy_copy(model, 0.05), None, name="draft")
    apply_kernel(model, "on")  # as load_model leaves it: weights in the kernel's panels
    loaded = LoadedModel(model, None, name=arch, extra={"gguf": path})
    quantize_loaded(loaded, ModelSpec.parse(f"{arch}:int4"), keep_weights=False)
    assert loaded.extra["int4_weights"] == "gguf" and loaded.name == f"{arch}:int4"
    modules = dict(model.named_modules())
    for hf, _ in LAYOUT.values():
        module = modules[hf]
        assert is_quantized(module)
        if LAYOUT_TYPES[hf] == T.Q6_K:  # 6-bit: exactly the file's weights
            assert torch.equal(q6_weights(module), expected[hf]), hf
        elif hf in expected:  # 4-bit: exactly the file's codes times its float16 step, plus min
            assert torch.equal(int4_weights(module), expected[hf]), hf
        else:  # Q8_0: int8 per row, kept at its precision
            q, scale = int8_weights(module)
            assert q.dtype == torch.int8 and scale.shape == (module.weight.shape[0],), hf

    alone = SpeculativeDecoder(loaded).generate([1, 2, 3], max_new_tokens=24).token_ids
    result = SpeculativeDecoder(loaded, draft, k=3, k_policy="fixed").generate(
        [1, 2, 3], max_new_tokens=24
    )
    assert result.token_ids == alone and result.stats.drafted > 0


@needs_kernel()
def test_a_drafts_int4_takes_four_bits_everywhere(tmp_path):
    # a draft is verified token by token: the file's int8 types would only slow it down
    model, path, _ = gguf_made(tmp_path, "qwen2")
    apply_kernel(model, "on")
    loaded = LoadedModel(model, None, name="qwen2", extra={"gguf": path})
    quantize_loaded(loaded, ModelSpec.parse("qwen2:int4"), keep_weights=True, role="draft")
    assert loaded.extra["int4_weights"] == "requantized"
    modules = dict(model.named_modules())
    down = modules["model.layers.0.mlp.down_proj"]  # Q6_K in the file: 6-bit for a target
    assert is_quantized(down) and int4_weights(down).shape == down.weight.shape


@needs_kernel()
def test_a_file_of_another_model_falls_back_to_requantizing(tmp_path, capsys):
    model, path, _ = gguf_made(tmp_path, "qwen2")
    other = _model("qwen2", seed=1).to(torch.bfloat16)
    codes, why = gguf_codes(other, path)
    assert codes is None and "is not model.layers.0" in why
    loaded = LoadedModel(other, None, name="other", extra={"gguf": path})
    quantize_loaded(loaded, ModelSpec.parse("other:int4"), keep_weights=True)
    assert loaded.extra["int4_weights"] == "requantized"
    assert "not the GGUF's own codes" in capsys.readouterr().err
    assert is_quantized(other.lm_head)
    codes, what = gguf_codes(model, path)
    assert codes is not None and len(codes) == 6
    assert set(codes.other) == {"model.layers.0.self_attn.v_proj"}
    assert set(codes.q6) == {"model.layers.0.mlp.down_proj"}
    assert what == (
        "4-bit from the GGUF's own codes for 6 linears (Q4_0, Q4_1, Q4_K), 6-bit for 1 (Q6_K), "
        "int8 for the 1 of other types (Q8_0)"
    )


@needs_kernel()
def test_a_codes_file_keeps_what_int4_reads_and_computes_the_same(tmp_path):
    """`write_codes`: the 4-bit and 6-bit linears byte for byte, the rest named only; the model
    made from it is the model made from the whole file, and says the same of its linears."""
    model, path, _ = gguf_made(tmp_path, "qwen2")
    dest = write_codes(path, tmp_path / "codes" / "qwen2.int4-codes.gguf")
    whole, codes = GGUFReader(path), GGUFReader(dest)
    kept = {t.name: t for t in codes.tensors}
    assert set(kept) == {n for n, (_, q) in LAYOUT.items() if q in BLOCK_BYTES}  # not the Q8_0
    for tensor in whole.tensors:
        if tensor.name in kept:
            assert kept[tensor.name].tensor_type == tensor.tensor_type
            assert np.array_equal(np.asarray(kept[tensor.name].data), np.asarray(tensor.data))
    assert list(codes.fields[LEFT_OUT].contents()) == ["blk.0.attn_v.weight=Q8_0"]
    assert codes.fields["general.architecture"].contents() == "qwen2"
    assert gguf_codes(model, dest)[1] == gguf_codes(model, path)[1]  # the same stderr line
    assert dest.stat().st_size < path.stat().st_size
    assert list((tmp_path / "codes").iterdir()) == [dest]  # written beside, renamed into place
    again = write_codes(dest, tmp_path / "again.gguf")  # from a codes file: the same reading
    assert gguf_codes(model, again)[1] == gguf_codes(model, path)[1]

    results = []
    for source in (path, dest):
        twin = _model("qwen2").to(torch.bfloat16)
        twin.load_state_dict(model.state_dict())
        apply_kernel(twin, "on")
        loaded = LoadedModel(twin, None, name="qwen2", extra={"gguf": source})
        quantize_loaded(loaded, ModelSpec.parse("qwen2:int4"), keep_weights=False)
        assert loaded.extra["int4_weights"] == "gguf"
        with torch.inference_mode():
            results.append(twin(torch.tensor([[1, 2, 3, 4]])).logits)
    assert torch.equal(*results)


def test_a_presets_codes_come_from_a_whole_gguf_its_codes_file_or_one_rebuilt(
    tmp_path, monkeypatch
):
    model, path, _ = gguf_made(tmp_path, "qwen2")
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    preset = dataclasses.replace(
        presets.PRESETS["smollm2-135m-instruct"],
        name="tiny",
        gguf_filename="tiny.gguf",
        total_size=path.stat().st_size,
    )
    monkeypatch.setitem(presets.PRESETS, "tiny", preset)
    rebuilt = []

    def rebuild(name, out_dir, progress=True):  # the wheels joined again, here a copy
        rebuilt.append(Path(out_dir).parent)
        return Path(shutil.copy(path, Path(out_dir) / "tiny.gguf"))

    monkeypatch.setattr(fetch, "rebuild_gguf", rebuild)
    got, why = preset_gguf("tiny", progress=False)
    assert (got, why) == (codes_file("tiny"), "") and rebuilt == [cache]
    assert got.name == "tiny.int4-codes.gguf" and sorted(p.name for p in cache.iterdir()) == [
        "gguf"
    ]  # the rebuilt GGUF and its work folder are gone
    assert gguf_codes(model, got)[1] == gguf_codes(model, path)[1]
    assert preset_gguf("tiny", progress=False) == (got, "") and len(rebuilt) == 1  # kept
    whole = Path(shutil.copy(path, fetch.gguf_dir() / "tiny.gguf"))
    assert preset_gguf("tiny", progress=False) == (whole, "")  # a whole GGUF there is read

    def offline(name, out_dir, progress=True):
        raise fetch.FetchError("no network")

    monkeypatch.setattr(fetch, "rebuild_gguf", offline)
    whole.unlink()
    got.unlink()
    assert preset_gguf("tiny", progress=False) == (
        None,
        "its GGUF could not be rebuilt (no network)",
    )
