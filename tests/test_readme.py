"""The commands in README.md and docs/usage.md run as written, and the docs' links resolve.

Every ```bash block of those two pages either runs here, or is marked by an HTML comment line
right before it, `<!-- not run in tests: REASON -->` (it needs the real models, downloads
something, needs a running server, or is the set-up CI runs itself). So a command cannot be
added to them without running here or saying why not. A block runs in bash (`set -euo
pipefail`) in a scratch folder that holds a tiny saved model, `./my-saved-model`, with
`specdecode` meaning `python -m specdecode.cli` on this tree's src (the console script may
belong to another checkout), an empty model cache and no network for pip or the hub, so a
command that would need a real model fails here instead of fetching one.
"""

from __future__ import annotations

import ast
import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
RUN_PAGES = ("README.md", "docs/usage.md")  # the pages whose commands must run or be marked
LINK_PAGES = (
    "README.md",
    "docs/*.md",
    "lab/*.md",
    "lab/notes/*.md",
)  # the pages whose links must resolve
MARK = re.compile(r"<!-- not run in tests: (\S.*\S) -->")
FENCE = re.compile(r"```(\S*)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str | None  # the reason it is not run, from the comment line right before it

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.fullmatch(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark = MARK.fullmatch(lines[i - 1]) if i else None
        text = "\n".join(lines[i + 1 : end])
        blocks.append(Block(page, i + 1, opening.group(1), text, mark and mark.group(1)))
        i = end + 1
    return blocks


BLOCKS = [block for page in RUN_PAGES for block in fenced_blocks(page)]
RUN = [b for b in BLOCKS if b.lang == "bash" and b.mark is None]


def test_markers_are_well_formed_and_precede_bash_blocks():
    for page in RUN_PAGES:
        lines = (ROOT / page).read_text().splitlines()
        for n, line in enumerate(lines):
            if "not run in tests" not in line:
                continue
            assert MARK.fullmatch(line), (
                f"{page}:{n + 1}: write `<!-- not run in tests: REASON -->`"
            )
            nxt = lines[n + 1] if n + 1 < len(lines) else ""
            assert nxt == "```bash", f"{page}:{n + 1}: a marker goes right before a ```bash block"
    assert RUN, "no block of README.md or docs/usage.md runs in the tests"


def test_setup_commands_are_marked():
    """The README's first block is the set-up that CI (.ci/run) runs itself."""
    first = fenced_blocks("README.md")[0]
    assert first.lang == "bash" and first.mark is not None
    assert "pip install -e '.[test]' && python -m pytest -q" in first.text


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A working folder with `./my-saved-model`, and the environment the blocks run in."""
    root = tmp_path_factory.mktemp("readme")
    work = root / "work"
    tiny_llama(seed=0).save_pretrained(work / "my-saved-model")  # float32, no tokenizer
    bin_dir = root / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "specdecode"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m specdecode.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(ROOT / "src"),
        SPECDECODE_CACHE=str(root / "cache"),  # empty: no preset is cached
        PIP_NO_INDEX="1",  # a preset fetch fails at once instead of downloading
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    return work, env


@pytest.mark.parametrize("block", RUN, ids=str)
def test_bash_block_runs(block: Block, scratch):
    work, env = scratch
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"{block} failed (exit {proc.returncode}); make it run here or mark it "
        f"`<!-- not run in tests: REASON -->`\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=str)
def test_python_blocks_parse(block: Block):
    ast.parse(block.text, filename=str(block))


# the README's example loads these presets; the test swaps in tiny_folders' models (conftest.py)
EXAMPLE_PRESETS = {"qwen2.5-coder-1.5b-instruct": "target", "qwen2.5-coder-0.5b-instruct": "draft"}


def test_readme_python_example_runs(tiny_folders, monkeypatch, capsys):
    """The README's Python example runs as written on a tiny target and draft (saved with a
    chat-template tokenizer) in place of its two presets, prints its text, and each greedy
    `generate` it calls returns what the target alone generates, token for token."""
    import specdecode
    from specdecode import SpeculativeDecoder

    calls = []

    class Recording(SpeculativeDecoder):  # what the example's `from specdecode import` gets
        def generate(self, *args, **kwargs):
            result = super().generate(*args, **kwargs)
            calls.append((self, args, kwargs, result))
            return result

    monkeypatch.setattr(specdecode, "SpeculativeDecoder", Recording)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = [b for b in fenced_blocks("README.md") if b.lang == "python"]
    assert blocks, "README.md has no ```python example"
    for block in blocks:
        code = block.text
        for preset, folder in EXAMPLE_PRESETS.items():
            code = code.replace(f'"{preset}"', repr(str(tiny_folders / folder)))
        assert "qwen2.5" not in code, f"{block}: load the presets as {list(EXAMPLE_PRESETS)}"
        exec(compile(code, str(block), "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out
    assert calls, "the README's example never calls SpeculativeDecoder.generate"
    for decoder, args, kwargs, result in calls:
        assert result.token_ids and result.stats.new_tokens == len(result.token_ids)
        assert result.text and result.text in printed
        params = decoder.sampling_params(
            kwargs.get("temperature"), kwargs.get("top_k"), kwargs.get("top_p")
        )
        if decoder.drafter is not None and params.greedy:
            alone = SpeculativeDecoder(decoder.target).generate(*args, **kwargs)
            assert result.token_ids == alone.token_ids


# --- links -------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def outside_fences(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside code blocks: fenced ones, and indented ones (a
    line indented by 4 spaces or more after a blank line, and the indented lines after it)."""
    out, fenced, indented, previous = [], False, False, ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            deep = line.startswith("    ")
            indented = (deep and (indented or not previous.strip())) or (indented and not line)
            if not indented:
                out.append((n, line))
        previous = line
    return out


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    found, seen = set(), {}
    for _, line in outside_fences(path):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            base = slug(heading.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def link_pages() -> list[Path]:
    return sorted({p for pattern in LINK_PAGES for p in ROOT.glob(pattern)})


def test_relative_links_resolve():
    broken = []
    for page in link_pages():
        for n, line in outside_fences(page):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # not in code spans
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                where = f"{page.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_matches_github():
    assert slug("The bfloat16 CPU kernel: verification nearly free (`specdecode.kernels`)") == (
        "the-bfloat16-cpu-kernel-verification-nearly-free-specdecodekernels"
    )
    assert slug("`specdecode demo` — the main job") == "specdecode-demo--the-main-job"
    assert slug("The draft's forward") == "the-drafts-forward"
