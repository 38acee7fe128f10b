"""Imports run one way (docs/architecture.md, Invariants 5): the decoding core imports no drafter
implementation, no kernel, no model loading, no bench and no server."""

from __future__ import annotations

import subprocess
import sys

import pytest

OUTSIDE_THE_CORE = (
    "specdecode.kernels",
    "specdecode.drafters",
    "specdecode.models",
    "specdecode.bench",
    "specdecode.server",
    "specdecode.engine",
    "specdecode.cli",  # and cli_args
    "specdecode.config",
    "specdecode.demo",
    "specdecode.hf_generate",
)


def imported_after(statement: str) -> list[str]:
    """The specdecode modules a fresh interpreter holds after running `statement`."""
    code = (
        f"{statement}\nimport sys\n"
        "print('\\n'.join(m for m in sys.modules if m.startswith('specdecode')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return out.split()


@pytest.mark.parametrize(
    "module",
    [
        "decode",
        "batch",
        "store",
        "step",
        "tree_decode",
        "tree",
        "policies",
        "drafter",
        "types",
        "request",
    ],
)
def test_the_core_imports_nothing_outside_it(module):
    loaded = imported_after(f"import specdecode.{module}")
    assert f"specdecode.{module}" in loaded
    outside = [m for m in loaded if m.startswith(OUTSIDE_THE_CORE)]
    assert outside == [], f"specdecode.{module} pulls in {outside}"


def test_the_package_loads_its_public_names_on_use():
    loaded = imported_after("import specdecode")
    assert not [m for m in loaded if m.startswith(OUTSIDE_THE_CORE)]
    loaded = imported_after("from specdecode import SpeculativeDecoder, load_model")
    assert "specdecode.engine" in loaded and "specdecode.models.loading" in loaded


def test_every_public_name_resolves():
    import specdecode

    for name in specdecode.__all__:
        assert getattr(specdecode, name).__name__ == name


def test_the_drafters_keep_their_protocol_import():
    from specdecode import drafter, drafters
    from specdecode.drafters import base
    from specdecode.drafters.ngram import NgramDrafter

    assert drafters.Drafter is drafter.Drafter and base.Drafter is drafter.Drafter
    assert base.BaseDrafter is drafter.BaseDrafter
    assert isinstance(NgramDrafter(), drafter.Drafter)
