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
