"""benchmarks/vs_llamacpp.py without llama.cpp: its parsers on output captured from llama.cpp
0.5.0-dev (commit 0c1e570, SmolLM2-135M, tests/data/llamacpp/), its settings, its report."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_benchmark

DATA = Path(__file__).resolve().parent / "data" / "llamacpp"


_load = load_benchmark


lio = _load("llamacpp_io")
vs = _load("vs_llamacpp")

# the prompt of the captured runs, as our chat template formats it for SmolLM2, and its ids
PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"
)
IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
       407, 19712, 8182, 2, 198, 1, 4093, 198, 19161, 253, 421, 30614, 563, 260, 3426, 30, 2,
       198, 1, 520, 9531, 198]  # fmt: skip


def _read(name: str) -> str:
    return (DATA / name).read_text()


def test_completion_timing_lines_and_prompt_ids():
    run = lio.parse_completion(_read("completion.stderr"), _read("completion.stdout"))
    assert (run.prompt_tokens, run.new_tokens, run.decode_tokens) == (37, 16, 15)
    assert run.prefill_s == pytest.approx(1.15037) and run.decode_s == pytest.approx(0.58237)
    assert run.total_s == pytest.approx(1.76829)
    assert run.decode_tokens_per_s == pytest.approx(15 / 0.58237)  # its "25.76 tokens per second"
    assert run.prefill_tokens_per_s == pytest.approx(37 / 1.15037)
    assert run.tokens_per_s == pytest.approx(16 / 1.76829)
    # this capture read the prompt with -f, which drops a trailing newline: the last id is missing
    assert run.prompt_ids == IDS[:-1]
    assert run.text.strip() == "In the depths of the blue, a lone vessel sails, a reflection of"


def test_a_prompt_that_lost_a_token_is_caught():
    run = lio.parse_completion(_read("completion.stderr"))
    row = vs.llama_row(lio.LLAMA, vs.BenchPrompt("p1", "chat", ["hi"]), IDS, run)
    assert row["prompt_match"] is False
    assert (row["tool_prompt_tokens"], row["prompt_tokens"]) == (37, 38)
    assert vs.llama_row(lio.LLAMA, vs.BenchPrompt("p1", "chat", ["hi"]), IDS[:-1], run)[
        "prompt_match"
    ]


def test_speculative_lines():
    run = lio.parse_speculative(
        _read("speculative_simple.stderr"), _read("speculative_simple.stdout"), PROMPT
    )
    assert (run.prompt_tokens, run.new_tokens, run.drafted, run.accepted) == (38, 20, 15, 15)
    assert run.decode_tokens_per_s == pytest.approx(20 / 6.387)
    assert run.prefill_tokens_per_s == pytest.approx(38 / 4.245)
    assert run.tokens_per_s == pytest.approx(20 / (4.245 + 6.387))
    assert run.text == (
        "In the depths of the blue, a lone vessel sails, a reflection of the unending beauty of"
    )
    row = vs.llama_row(lio.spec_label(3), vs.BenchPrompt("p1", "chat", ["hi"]), IDS, run)
    assert row["prompt_match"] is True  # the count: speculative-simple logs no ids
    assert row["acceptance_rate"] == 1.0
    assert row["mean_acceptance_length"] == pytest.approx(4.0)  # 20 tokens in 5 steps


def test_bench_json_and_version():
    bench = lio.parse_bench(_read("llama_bench.json"))
    assert bench["test"] == "tg16" and bench["tokens_per_s"] == pytest.approx(6.062252)
    assert bench["repetitions"] == 1 and bench["threads"] == 2
    assert bench["build_commit"] == "0c1e570"
    version = "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64"
    assert lio.parse_version(version) == {"version": "0.5.0-dev", "build": "1", "commit": "0c1e570"}


def test_missing_lines_say_what_was_expected():
    with pytest.raises(
        ValueError, match=r"no prompt eval / eval / total time line.*ends: loading \| oops"
    ):
        lio.parse_completion("loading\noops")
    with pytest.raises(ValueError, match=r"no decoded line \(expected 'decoded N tokens"):
        lio.parse_speculative("encoded   38 tokens in    4.245 seconds, speed: 8.9 t/s")
    with pytest.raises(ValueError, match="llama-bench -o json gave no test result"):
        lio.parse_bench("[]")


def test_commands_keep_the_prompt_as_it_is():
    bin_dir, gguf = Path("/b"), Path("/m.gguf")
    cmd = lio.completion_command(bin_dir, gguf, PROMPT, 64, 2, 4096)
    assert cmd[0] == "/b/llama-completion" and cmd[cmd.index("-p") + 1] == PROMPT
    for flag in ("--no-escape", "-no-cnv", "--verbose-prompt"):
        assert flag in cmd
    assert cmd[cmd.index("--temp") + 1] == "0" and cmd[cmd.index("-t") + 1] == "2"
    cmd = lio.speculative_command(bin_dir, gguf, Path("/d.gguf"), PROMPT, 64, 2, 4096, 5)
    assert (
        cmd[cmd.index("-md") + 1] == "/d.gguf" and cmd[cmd.index("--spec-draft-n-max") + 1] == "5"
    )
    cmd = lio.bench_command(bin_dir, gguf, 64, 2, 5)
    assert " ".join(cmd[1:]) == "-m /m.gguf -p 0 -n 64 -t 2 -r 5 -o json"


def test_cpu_description():
    cpuinfo = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 "
        "avx512_vnni avx_vnni\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R14\n"
    )
    cpu = lio.describe_cpu(cpuinfo)
    assert cpu["model_name"] == "AMD EPYC 9R14" and (cpu["family"], cpu["model"]) == ("25", "17")
    assert cpu["flags"] == ["avx2", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "fma"]
    assert cpu["logical_cpus"] == 2
    assert lio.describe_cpu("")["model_name"] == "unknown"


def test_ours_settings():
    parse = lio.OursSpec.parse
    assert parse("bf16") == lio.OursSpec("bf16")
    assert parse("int4+int4:k=3") == lio.OursSpec("int4", "int4", k=3)
    tree = parse("bf16+int4:tree=dynamic:5,6,2,0.3")
    assert tree.tree == "dynamic:5,6,2,0.3" and tree.label == (
        "ours bf16 + int4 draft tree dynamic:5,6,2,0.3"
    )
    assert tree.baseline == "ours bf16" and tree.speculative
    assert [parse(s).label for s in lio.DEFAULT_OURS][:3] == [
        "ours bf16",
        "ours int4",
        "ours int4 + int4 draft k=3",
    ]
    for bad, says in [
        ("fp8", "target weights 'fp8'"),
        ("int4+int2:k=3", "draft weights 'int2'"),
        ("int4+int4", "k=K"),
        ("int4+int4:k=0", "k=K"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse(bad)
    with pytest.raises(SystemExit):  # a bad tree shape stops the script before loading
        vs.parse_args(["--llama-bin", str(DATA), "--out", "x", "--ours", "bf16+int4:tree=x"])


def _run(prompt, category, method, decode, e2e, **extra):
    row = {
        "prompt_id": prompt,
        "category": category,
        "method": method,
        "prompt_tokens": 30,
        "new_tokens": 64,
        "prefill_tokens_per_s": 100.0,
        "decode_tokens_per_s": decode,
        "tokens_per_s": e2e,
        "identical_to_target": None,
        "mean_acceptance_length": None,
        "prompt_match": None,
    }
    return row | extra


def _fake_results() -> dict:
    spec = "ours bf16 + int4 draft k=3"
    runs = [
        _run("a1", "chat", lio.LLAMA, 10.0, 8.0, prompt_match=True, tool_prompt_tokens=30),
        _run("a1", "chat", "ours bf16", 5.0, 4.0),
        _run("a1", "chat", spec, 20.0, 16.0, identical_to_target=True, mean_acceptance_length=3.0),
        _run("b1", "math", lio.LLAMA, 10.0, 10.0, prompt_match=False, tool_prompt_tokens=29),
        _run("b1", "math", "ours bf16", 5.0, 5.0),
        _run(
            "b1",
            "math",
            spec,
            40.0,
            40.0,
            identical_to_target=False,
            mean_acceptance_length=4.0,
            first_divergence={"position": 7, "top2_margin": 0.125},
        ),
    ]
    return {
        "started": "2026-12-02 00:00:00 UTC",
        "config": {
            "command": "python -m benchmarks.vs_llamacpp --llama-bin /b --out x",
            "llama_bin": "/b",
            "target": "t",
            "draft": "d",
            "target_gguf": "/g/t.gguf",
            "draft_gguf": "/g/d.gguf",
            "categories": ["chat", "math"],
            "limit": 1,
            "max_new_tokens": 64,
        },
        "machine": {
            "cpu": {"model_name": "AMD EPYC", "family": "23", "model": "49", "flags": ["avx2"]},
            "threads": 2,
            "versions": {"torch": "2.13.0+cpu"},
        },
        "llama_cpp": {"version": "0.5.0-dev", "build": "1", "commit": "0c1e570"},
        "llama_bench": {
            "test": "tg64",
            "tokens_per_s": 11.0,
            "stddev_tokens_per_s": 0.5,
            "repetitions": 5,
            "threads": 2,
        },
        "methods": [lio.LLAMA, "ours bf16", spec],
        "runs": runs,
    }


def test_summary_pairs_ratios_per_prompt():
    rows = {
        r["method"]: r for r in lio.summarize(_fake_results()["runs"], _fake_results()["methods"])
    }
    spec = rows["ours bf16 + int4 draft k=3"]
    assert spec["decode_by_category"] == pytest.approx({"chat": 20.0, "math": 40.0})
    assert spec["e2e_by_category"] == pytest.approx({"chat": 16.0, "math": 40.0})
    assert spec["decode_tokens_per_s"] == pytest.approx((20 * 40) ** 0.5)
    assert spec["decode_vs_llama"] == pytest.approx((2 * 4) ** 0.5)
    assert spec["e2e_vs_llama"] == pytest.approx((2 * 4) ** 0.5)
    assert spec["identical"] == "1/2" and spec["mean_acceptance_length"] == 3.5
    assert rows[lio.LLAMA]["decode_vs_llama"] == pytest.approx(1.0)
    assert rows["ours bf16"]["identical"] is None


def test_report_ends_with_the_main_table():
    report = lio.render_report(_fake_results())
    lines = report.strip().splitlines()
    assert lines[-5].startswith("| method | decode tok/s | e2e tok/s")
    assert lines[-1] == (
        "| ours bf16 + int4 draft k=3 | 28.28 | 25.30 | 100.0 | 2.83x | 2.83x | 1/2 | 3.50 | 64.0 |"
    )
    assert "| ours bf16 | 5.00 | 4.47 | 100.0 | 0.50x | 0.50x | - | - | 64.0 |" in lines
    assert "llama.cpp 0.5.0-dev (build 1, commit 0c1e570)" in report
    assert "AMD EPYC (family 23, model 49), 2 threads for both sides; flags: avx2" in report
    assert "llama-bench tg64" in report and "11.00 ± 0.50 tokens/s" in report
    assert "**Prompt tokens differ** in 1 of 2 llama.cpp runs" in report
    assert "- b1 (llama.cpp): llama.cpp 29 tokens, ours 30" in report
    assert "| method | chat | math | geomean |" in report
    # decode, then whole-generation tokens/s per category (the long-prompt categories' bar)
    decode = report.index("## Decode tokens/s per category")
    e2e = report.index("## e2e tokens/s per category (prefill included)")
    assert decode < e2e < report.index("## Summary")
    assert "| ours bf16 + int4 draft k=3 | 16.00 | 40.00 | 25.30 |" in report[e2e:]
    assert "| ours bf16 + int4 draft k=3 | 20.00 | 40.00 | 28.28 |" in report[decode:e2e]
    assert (
        "- b1, ours bf16 + int4 draft k=3: from token 7 (target's top-2 margin there: 0.125)"
        in (report)
    )


def test_the_report_names_our_draft_vocabulary():
    results = _fake_results()
    assert "draft vocabulary" not in lio.render_report(results)  # none recorded: every id
    results["config"]["draft_vocab"] = 65536
    assert (
        "ours: its output layer on the first 65536 ids and the special ones, the draft vocabulary"
        in " ".join(lio.render_report(results).split())
    )
