"""benchmarks/llamacpp_kld.py without llama.cpp: its parsers on output captured from
llama-perplexity (llama.cpp 0.5.0-dev, commit 0c1e570, qwen2.5-coder-1.5b-instruct: its bf16 GGUF
as the reference, the Q4_K_M file against it, -c 512; tests/data/llamacpp/perplexity_*.log), the
saved log-probability file, llama-perplexity's windows and the report."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.bench.quality import answer_log_probs, token_quality

from conftest import load_benchmark, tiny_llama

DATA = Path(__file__).resolve().parent / "data" / "llamacpp"


_load = load_benchmark


kio = _load("llamacpp_kld_io")
kld_script = _load("llamacpp_kld")


def _read(name: str) -> str:
    return (DATA / name).read_text()


# -- the tool's output --------------------------------------------------------------------------


def test_the_reference_run_gives_its_chunks_and_perplexity():
    base = kio.parse_base(_read("perplexity_base.log"))
    assert base == {
        "chunks": 3,
        "n_ctx": 512,
        "perplexity": 13.4481,
        "perplexity_uncertainty": 1.45239,
    }


def test_the_kl_divergence_run_gives_its_statistics():
    stats = kio.parse_kld(_read("perplexity_kld.log"))
    assert (stats["chunks"], stats["n_ctx"], stats["tokens"]) == (3, 512, 3 * 255)
    assert stats["perplexity"] == 13.449428 and stats["perplexity_base"] == 13.44807
    assert stats["ln_ppl_correlation"] == pytest.approx(0.9998)
    assert stats["kld_mean"] == 0.001358 and stats["kld_mean_uncertainty"] == 0.000062
    assert stats["kld_median"] == 0.000877
    assert (stats["kld_p99"], stats["kld_p99_9"], stats["kld_max"]) == (
        0.008657,
        0.012109,
        0.012552,
    )
    assert stats["kld_min"] == -0.000071  # llama.cpp's per-position KL is not clamped at 0
    assert stats["top1_agreement"] == pytest.approx(0.97647)  # "Same top p: 97.647 ± 0.548 %"
    assert stats["top1_agreement_uncertainty"] == pytest.approx(0.00548)
    assert stats["delta_p_rms"] == pytest.approx(0.00742)
    assert stats["delta_p_mean"] == pytest.approx(-0.00051)


def test_output_without_statistics_is_a_clear_error():
    text = _read("perplexity_kld.log")
    cut = text[: text.index("====== Perplexity statistics")]  # as below 100 scored positions
    with pytest.raises(ValueError, match="100 scored positions"):
        kio.parse_kld(cut)
    with pytest.raises(ValueError, match="final PPL"):
        kio.parse_base(_read("perplexity_base.log").split("[1]")[0])
    with pytest.raises(ValueError, match="chunks"):
        kio.parse_base("main: error: you need at least 1024 tokens")


def test_the_commands_save_then_read_the_reference():
    bin_dir, model, text, kld = Path("/b"), Path("m.gguf"), Path("t.txt"), Path("x.kld")
    base = kio.base_command(bin_dir, model, text, kld, 512, 2)
    assert base[0] == "/b/llama-perplexity" and "--kl-divergence" not in base
    assert base[base.index("--kl-divergence-base") + 1] == "x.kld"
    assert base[base.index("-c") + 1] == "512" and base[base.index("-t") + 1] == "2"
    assert kio.kld_command(bin_dir, model, text, kld, 512, 2)[-5:] == [
        "--kl-divergence", "-c", "512", "-t", "2",
    ]  # fmt: skip
    assert kio.parse_version("version: 0.5.0-dev (build 1, commit 0c1e570)\n")["commit"] == (
        "0c1e570"
    )


# -- the saved reference ------------------------------------------------------------------------


def _encode(logits: np.ndarray) -> np.ndarray:
    """One position's row as llama.cpp writes it (perplexity.cpp's log_softmax with log_prob)."""
    top = logits.max()
    low = max(logits.min(), top - 16)
    lse = math.log(np.exp((logits - top).astype(np.float64)).sum())
    scale = np.float32((top - low) / 65535)
    codes = np.where(logits > low, np.rint((logits - low) / scale), 0).astype(np.uint16)
    head = np.array([scale, low - top - lse], dtype=np.float32).view(np.uint16)
    pad = np.zeros(len(codes) % 2, dtype=np.uint16)
    return np.concatenate([head, codes, pad])


def _write_kld(path: Path, n_ctx: int, logits: np.ndarray, tokens: np.ndarray) -> None:
    """A file in llama-perplexity's layout; logits [n_chunk, scored, V]."""
    n_chunk, _, vocab = logits.shape
    with path.open("wb") as f:
        f.write(b"_logits_")
        f.write(np.array([n_ctx, vocab, n_chunk], dtype=np.int32).tobytes())
        f.write(tokens.astype(np.int32).tobytes())
        for chunk in logits:
            for row in chunk:
                f.write(_encode(row).tobytes())


def test_the_saved_reference_reads_back_as_llama_cpp_decodes_it(tmp_path):
    rng = np.random.default_rng(0)
    n_ctx, vocab, n_chunk = 8, 5, 2  # an odd vocabulary: rows padded to even
    rows = kio.scored_per_chunk(n_ctx)
    logits = rng.normal(0, 3, size=(n_chunk, rows, vocab)).astype(np.float32)
    logits[1, 0, 4] = logits[1, 0].max() - 30  # more than 16 nats below the top: code 0
    tokens = np.arange(n_ctx * n_chunk) % vocab
    path = tmp_path / "base.kld"
    _write_kld(path, n_ctx, logits, tokens)
    kld = kio.read_kld_file(path)
    assert (kld.n_ctx, kld.n_vocab, kld.n_chunk, kld.row_width) == (8, 5, 2, 10)
    assert kld.tokens.tolist() == tokens.tolist()
    for chunk in range(n_chunk):
        got = kld.log_probs(chunk)  # [3, 5]
        want = torch.log_softmax(torch.from_numpy(logits[chunk]).double(), -1).numpy()
        near = want > kio.LOG_PROB_FLOOR
        assert np.allclose(got[near], want[near], atol=16 / 65535)
    assert kld.log_probs(1)[0, 4] <= kio.LOG_PROB_FLOOR  # left out of llama.cpp's sum
    with pytest.raises(IndexError):
        kld.log_probs(2)
    (tmp_path / "cut.kld").write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="bytes, expected"):
        kio.read_kld_file(tmp_path / "cut.kld")
    (tmp_path / "no.kld").write_bytes(b"GGUF" + path.read_bytes()[4:])
    with pytest.raises(ValueError, match="not a llama-perplexity"):
        kio.read_kld_file(tmp_path / "no.kld")


# -- llama-perplexity's windows -----------------------------------------------------------------


def test_windows_are_llama_cpp_chunks_scoring_their_second_half():
    tokens = list(range(100, 121))  # 21 tokens: 2 chunks of 8, 5 dropped
    chunks = kio.windows(tokens, 8)
    assert len(chunks) == 2
    context, scored = chunks[1]
    assert context == list(range(108, 113)) and scored == [113, 114, 115]
    assert all(len(s) == kio.scored_per_chunk(8) for _, s in chunks)
    assert kio.windows(tokens, 8, bos=1)[1][0][0] == 1  # BOS in each chunk's first slot
    with pytest.raises(ValueError):
        kio.windows(tokens, 2)


def test_teacher_forcing_a_window_scores_llama_cpp_positions():
    """llama.cpp scores the logits at positions n_ctx/2 .. n_ctx-2 of each chunk against the
    next token: the same rows as answer_log_probs(context, scored) of a window."""
    model = tiny_llama(1)
    tokens = [int(t) for t in torch.randint(3, 60, (20,), generator=torch.manual_seed(0))]
    n_ctx = 10
    context, scored = kio.windows(tokens, n_ctx)[1]
    window = tokens[n_ctx : 2 * n_ctx]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([window])).logits[0].float()  # [10, V]
    full = torch.log_softmax(logits, -1)[n_ctx // 2 : n_ctx - 1]
    assert torch.allclose(answer_log_probs(model, context, scored), full, atol=1e-6)
    assert scored == window[n_ctx // 2 + 1 :]


def test_token_check_finds_the_first_difference():
    assert kio.token_check([1, 2, 3, 4], [1, 2, 3])["identical"]
    check = kio.token_check([1, 2, 3, 4], [1, 5, 3])
    assert (check["identical"], check["first_difference"]) == (False, 1)
    assert kio.token_check([1, 2], [1, 2, 3])["first_difference"] == 2


def test_the_floor_leaves_out_the_reference_tail_as_llama_cpp_does():
    ref = torch.log(torch.tensor([[0.7, 0.3 - 1e-8, 1e-8]]))
    var = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    full = token_quality(ref, var, [0]).kld.item()
    cut = token_quality(ref, var, [0], floor=kio.LOG_PROB_FLOOR).kld.item()
    tail = 1e-8 * math.log(1e-8 / 0.1)  # log 1e-8 = -18.4, below the floor
    assert full == pytest.approx(cut + tail, abs=1e-9)
    assert cut == pytest.approx(0.7 * math.log(0.7 / 0.6) + (0.3 - 1e-8) * math.log(0.3 / 0.3))


# -- the script ---------------------------------------------------------------------------------


def test_the_report_has_the_table_and_says_how_the_tokens_compare():
    stats = {"tokens": 765, "kld_mean": 0.0014, "kld_median": 0.0009, "kld_p99": 0.0087}
    stats |= {"top1_agreement": 0.976, "perplexity": 13.45}
    result = {
        "started": "2026-12-02",
        "minutes": 20.0,
        "config": {
            "command": "python -m benchmarks.llamacpp_kld",
            "llamacpp_bin": "/b",
            "target": "qwen",
            "gguf": "/g/q4_k_m.gguf",
            "base_gguf": "/w/qwen-bf16.gguf",
            "ctx": 512,
            "limit": 3,
            "max_new_tokens": 64,
        },
        "machine": {
            "cpu": {"model_name": "AMD EPYC", "family": "23", "model": "49", "flags": ["avx2"]},
            "threads": 2,
            "versions": {"torch": "2"},
        },
        "llama_cpp": {"version": "0.5.0-dev", "commit": "0c1e570", "kld": stats | {"chunks": 3}},
        "text": {
            "prompts": 27,
            "chars": 100,
            "tokens": 1600,
            "token_check": kio.token_check([1, 2, 3], [1, 2]),
        },
        "rows": [{"name": "llama.cpp Q4_K_M", "harness": "h", "reference": "r"} | stats],
        "ours_per_category": {"int4": {"all": stats, "chat": stats}},
    }
    report = kio.render_report(result)
    assert "| llama.cpp Q4_K_M | h | r | 765 | 0.00140 | 0.00090 | 0.0087 | 0.9760 |" in report
    assert "tokens are ours, token for token, over all 2" in report
    assert "| int4 | 0.0014 / 0.98 |" in report
    result["text"]["token_check"] = kio.token_check([1, 2, 3], [1, 5])
    assert "tokens differ from ours** from token 1" in kio.render_report(result)


def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kld_script.parse_args(["--llamacpp-bin", str(tmp_path), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no llama-perplexity there" in capsys.readouterr().err
    (tmp_path / "llama-perplexity").write_text("")
    with pytest.raises(SystemExit):
        kld_script.parse_args(["--llamacpp-bin", str(tmp_path), "--out", "o", "--ctx", "7"])
    assert "--ctx: an even number" in capsys.readouterr().err


def test_the_float32_comparison_needs_the_first_run(tmp_path, capsys):
    exact = _load("llamacpp_kld_exact")
    (tmp_path / "llama-perplexity").write_text("")
    argv = ["--llamacpp-bin", str(tmp_path), "--work", str(tmp_path), "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        exact.parse_args(argv)
    assert exit_info.value.code == 2
    assert "run benchmarks/llamacpp_kld.py first" in capsys.readouterr().err
