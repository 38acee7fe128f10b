"""Writing a distillation's files so that an interruption or a full disk never leaves a file
that reads as complete: every file goes to a temporary name beside it and is renamed over the
final name once written (`os.replace`, atomic on one file system). A full disk (ENOSPC, EDQUOT)
becomes a `DiskFull` naming what was being written, and that what was written before it stays
(the run resumes from it)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


class DiskFull(RuntimeError):
    """The disk filled up while writing part of a distillation (the message says what, and that
    the run resumes from what was kept)."""


@contextlib.contextmanager
def disk_guard(what: str, path: Path) -> Iterator[None]:
    """Turns a full disk inside the block into `DiskFull` (other OSErrors pass unchanged)."""
    try:
        yield
    except OSError as err:
        if err.errno not in _NO_SPACE:
            raise
        raise DiskFull(
            f"the disk is full: writing {what} to {path} failed ({err.strerror or err}). Free some "
            "space and run the same command again: the data shards and checkpoints written "
            "before it are kept, and the run resumes from them"
        ) from None


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def write_atomic(path: Path, what: str, write: Callable[[Path], None]) -> None:
    """`write(temporary path)`, then the temporary file renamed to `path`; a failure removes the
    temporary file and leaves `path` as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(path)
    with disk_guard(what, path):
        try:
            write(partial)
            os.replace(partial, path)
        finally:
            if partial.exists():
                partial.unlink()


def save_json(path: Path, data: Any, what: str) -> None:
    write_atomic(path, what, lambda p: p.write_text(json.dumps(data, indent=1) + "\n"))


def save_tensors(path: Path, data: Any, what: str) -> None:
    """`data` (tensors in dicts / lists, numbers, strings) with torch.save, atomically."""
    write_atomic(path, what, lambda p: torch.save(data, p))


def load_tensors(path: Path) -> Any:
    """What `save_tensors` wrote (tensors and plain containers only: `weights_only`)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def replace_folder(partial: Path, final: Path) -> None:
    """The finished folder `partial` moved to `final` (a folder there before is removed first)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
