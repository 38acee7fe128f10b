"""`specdecode demo`: its default int8 draft falls back to the plain draft where int8 cannot run;
an explicit int8 draft that cannot run is an error."""

from __future__ import annotations

import io

import pytest

from specdecode import demo


def test_default_int8_draft_falls_back_to_the_plain_model(tiny_folders, monkeypatch, capsys):
    default = f"{tiny_folders / 'draft'}:int8"
    monkeypatch.setattr(demo, "DEFAULT_DRAFT", default)
    out = io.StringIO()
    rows = demo.main_demo(
        str(tiny_folders / "target"), default, k=2, max_new_tokens=6, dtype="float32",
        device="cpu", limit=1, out=out,
    )  # fmt: skip
    assert len(rows) == 1 and rows[0].identical  # float32: the target's own greedy output
    assert "int8 drafts run on the CPU kernel" in capsys.readouterr().err
    assert "speedup" in out.getvalue()


def test_an_explicit_int8_draft_that_cannot_run_is_an_error(tiny_folders):
    with pytest.raises(ValueError, match="int8 drafts run on the CPU kernel"):
        demo.main_demo(
            str(tiny_folders / "target"), f"{tiny_folders / 'draft'}:int8", k=2,
            max_new_tokens=6, dtype="float32", device="cpu", limit=1, out=io.StringIO(),
        )  # fmt: skip


@pytest.mark.parametrize("suffix", [":int8", ":int4"])
def test_a_default_quantized_draft_falls_back_whatever_its_bits(
    tiny_folders, monkeypatch, capsys, suffix
):
    default = f"{tiny_folders / 'draft'}{suffix}"
    monkeypatch.setattr(demo, "DEFAULT_DRAFT", default)
    rows = demo.main_demo(
        str(tiny_folders / "target"), default, k=2, max_new_tokens=6, dtype="float32",
        device="cpu", limit=1, out=io.StringIO(),
    )  # fmt: skip
    assert rows[0].identical
    assert f"drafting with {tiny_folders / 'draft'} in float32" in capsys.readouterr().err


def test_the_demo_drafts_a_tree_and_explains_its_step(tiny_folders):
    out = io.StringIO()
    rows = demo.main_demo(
        str(tiny_folders / "target"), str(tiny_folders / "draft"), k=2, max_new_tokens=12,
        dtype="float32", device="cpu", limit=2, out=out, tree="dynamic:4,3,2,0.2",
    )  # fmt: skip
    assert len(rows) == 2 and all(r.identical for r in rows)  # float32: the target's own output
    assert all(r.spec.stats.nodes_verified > 0 for r in rows)  # a tree, not a chain
    text = out.getvalue()
    assert "draft forwards (one per level" in text and "τ / (d·c + v)" in text


def test_the_cli_gives_the_default_pair_the_calibrated_setting_and_a_chosen_draft_a_chain(
    monkeypatch,
):
    from specdecode import cli

    calls = []
    monkeypatch.setattr(demo, "main_demo", lambda *a, **kw: calls.append(kw["tree"]))
    for argv in (
        ["demo"],
        ["demo", "--tree", "none"],
        ["demo", "--k", "3"],
        ["demo", "--draft", "ngram"],
        ["demo", "--quick"],
        ["demo", "--tree", "static:2,1"],
    ):
        args = cli.build_parser().parse_args(argv)
        assert args.func(args) == 0
    # the default pair: the calibration's choice (tests/test_calibrate.py runs it)
    assert calls == [demo.AUTO, None, None, None, None, "static:2,1"]


def test_the_demo_says_what_it_will_fetch_and_keep_before_it_starts(tmp_path, monkeypatch):
    import io

    from specdecode import demo
    from specdecode.models import presets

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))  # nothing cached
    out = io.StringIO()
    demo.announce_fetch(demo.DEFAULT_TARGET, [demo.DEFAULT_DRAFT, "ngram"], out)
    target, draft = (
        presets.PRESETS[demo.DEFAULT_TARGET],
        presets.PRESETS["qwen2.5-coder-0.5b-instruct"],
    )
    download = (target.total_size + draft.total_size) / 1e9
    kept = (target.converted_size + draft.converted_size) / 1e9  # a draft's :int4 reads no GGUF
    said = out.getvalue()
    assert f"{download:.2f} GB to download, then about {kept:.1f} GB in {tmp_path}" in said
    assert "wheels are dropped" in said and "GGUF" not in said
    out = io.StringIO()  # a target's :int4 reads its GGUF's own codes: they are kept
    demo.announce_fetch(f"{demo.DEFAULT_TARGET}:int4", [], out)
    kept = (target.converted_size + target.codes_size) / 1e9
    assert f"then about {kept:.1f} GB" in out.getvalue() and "GGUF" in out.getvalue()
    (tmp_path / demo.DEFAULT_TARGET).mkdir()  # a cached preset is not announced
    monkeypatch.setattr(
        demo, "cached_path", lambda name: tmp_path / name if name == demo.DEFAULT_TARGET else None
    )
    out = io.StringIO()
    demo.announce_fetch(demo.DEFAULT_TARGET, [], out)
    assert out.getvalue() == ""
    # a hybrid's model is fetched like a draft model; suffix drafting fetches nothing
    out = io.StringIO()
    demo.announce_fetch(demo.DEFAULT_TARGET, [f"{demo.DEFAULT_DRAFT}+suffix", "suffix"], out)
    assert f"{draft.total_size / 1e9:.2f} GB to download" in out.getvalue()
