"""The kernel build never hangs on a lock a killed build left behind, says it is building, and
builds once per version of its sources, whatever the path they come from."""

from __future__ import annotations

import os
import threading
import time

import pytest

from specdecode.kernels import build


def test_no_lock_returns_at_once(tmp_path):
    build.wait_for_build_lock(tmp_path / "lock", timeout_s=60.0)


def test_a_stale_lock_is_refused_with_its_path(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 3600  # left by a build killed an hour ago
    os.utime(lock, (old, old))
    with pytest.raises(build.KernelUnavailable) as err:
        build.wait_for_build_lock(lock, timeout_s=600.0)
    message = str(err.value)
    assert str(lock) in message
    assert "remove that file" in message
    assert build.LOCK_TIMEOUT_ENV in message


def test_a_fresh_lock_is_waited_for_until_the_build_ends(tmp_path, capsys):
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # the other build finishes
    build.wait_for_build_lock(lock, timeout_s=600.0, poll_s=0.05)
    assert not lock.exists()
    assert "waiting for another build" in capsys.readouterr().err


def test_a_lock_that_stays_ends_the_wait_at_the_timeout(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    with pytest.raises(build.KernelUnavailable, match="build lock"):
        build.wait_for_build_lock(lock, timeout_s=0.2, poll_s=0.05)


def test_progress_is_shown_only_for_long_work():
    lines: list[str] = []
    with build._progress("building", first_after_s=60.0, say=lines.append):
        pass  # a cached load: silent
    assert lines == []
    twice = threading.Event()

    def say(line: str) -> None:
        lines.append(line)
        if len(lines) >= 2:
            twice.set()

    with build._progress("building", first_after_s=0.01, every_s=0.01, say=say):
        assert twice.wait(timeout=60.0)  # it goes on while the work does
    assert all(line.startswith("building (") and line.endswith(" s)") for line in lines)


def test_sources_are_staged_once_per_version_of_them(tmp_path):
    # the build compiles copies at one path per version of the sources, so that a checkout or an
    # install elsewhere with the same sources finds the build done (ninja rebuilds on new paths)
    assert build.build_directory().name == build.source_digest()
    staged = build.staged_sources(tmp_path)
    assert [p.name for p in staged] == [p.name for p in build._SOURCES]
    for path in (*build._SOURCES, *build._HEADERS):
        assert (tmp_path / "src" / path.name).read_bytes() == path.read_bytes()
    first = staged[0].stat().st_mtime_ns
    staged[1].write_text("// stale")
    assert build.staged_sources(tmp_path) == staged
    assert staged[0].stat().st_mtime_ns == first  # unchanged: not written again
    assert staged[1].read_bytes() == build._SOURCES[1].read_bytes()  # changed: written again
    assert not list((tmp_path / "src").glob("*.tmp"))
