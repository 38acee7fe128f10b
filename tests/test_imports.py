"""Imports run one way (docs/architecture.md, Invariants 5, and "The floors"): the decoding core
imports no drafter implementation, no kernel, no model loading, no runtime and no app; no module
imports a module that imports it back (imports inside functions counted). The floors themselves are
the import-linter contract in pyproject.toml, which `.ci/run` checks; this file keeps what the
contract cannot say."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

OUTSIDE_THE_CORE = (
    "specdecode.kernels",
    "specdecode.drafters",
    "specdecode.models",
    "specdecode.bench",
    "specdecode.server",
    "specdecode.runtime.engine",
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


CORE = sorted(p.stem for p in (SRC / "specdecode" / "core").glob("*.py") if p.stem != "__init__")


def test_the_core_imports_nothing_outside_it():
    # every core module in one fresh interpreter: what they pull in together is the union of
    # what each pulls in alone, so nothing outside the core there means nothing for any of them
    # (one interpreter start instead of one per module)
    loaded = imported_after("\n".join(f"import specdecode.core.{m}" for m in CORE))
    assert {f"specdecode.core.{m}" for m in CORE} <= set(loaded)
    outside = [m for m in loaded if m.startswith(OUTSIDE_THE_CORE)]
    assert outside == [], f"the core pulls in {outside}"


def test_the_package_loads_its_public_names_on_use():
    loaded = imported_after("import specdecode")
    assert not [m for m in loaded if m.startswith(OUTSIDE_THE_CORE)]
    loaded = imported_after("from specdecode import SpeculativeDecoder, load_model")
    assert "specdecode.runtime.engine" in loaded and "specdecode.models.loading" in loaded


def test_every_public_name_resolves():
    import specdecode

    for name in specdecode.__all__:
        assert getattr(specdecode, name).__name__ == name


def test_the_drafters_keep_their_protocol_import():
    from specdecode import drafters
    from specdecode.core import protocols as drafter
    from specdecode.drafters import base
    from specdecode.drafters.ngram import NgramDrafter

    assert drafters.Drafter is drafter.Drafter and base.Drafter is drafter.Drafter
    assert base.BaseDrafter is drafter.BaseDrafter
    assert isinstance(NgramDrafter(), drafter.Drafter)


def _module_imports() -> dict[str, set[str]]:
    """Each specdecode module -> the specdecode modules it imports, anywhere in its file."""
    files = {}
    for path in (SRC / "specdecode").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*parent, base] if base else parent)
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = known(name) if name.startswith("specdecode") else None
                # a name from a package's __init__ imports that package, unless it is our own
                if target and target != module and not module.startswith(target + "."):
                    found.add(target)
        edges[module] = found
    return edges


def test_no_import_cycle_counting_imports_inside_functions():
    edges = _module_imports()
    cycles = []
    for start in edges:  # a path back to `start` through its imports is a cycle
        seen, stack = set(), [(start, [start])]
        while stack:
            module, path = stack.pop()
            for nxt in edges[module]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == [], "import cycles:\n" + "\n".join(sorted(set(cycles)))
