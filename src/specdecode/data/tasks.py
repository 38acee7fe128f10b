"""Task quality: short problems with checkable answers, written for this project, run greedy.

Two sets, JSON Lines in `data/tasks/` (package data):
- `code_tasks.jsonl`: 40 small Python functions, each `{"id", "kind": "code", "entry_point",
  "prompt", "tests", "solution"}`; the model's function passes when the file of its code followed
  by the `tests` (plain asserts) exits 0 in a subprocess (`run_code`). `solution` is ours, for
  the tests of the set itself.
- `math_tasks.jsonl`: 40 arithmetic word problems, `{"id", "kind": "math", "prompt", "work",
  "answer"}` (`work` is the Python expression the answer was computed with); the answer passes
  when the last number of the model's text equals it.

`run_code` is a best-effort fence, not a sandbox: a fresh isolated interpreter (`-I`) in a
temporary folder, a wall-clock timeout, CPU, memory and file-size limits where the OS has them,
sockets that refuse to connect, stdin closed. Generation is short (`MAX_NEW_TOKENS` per kind).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tqdm import tqdm

KINDS = ("code", "math")
_FILES = {"code": "code_tasks.jsonl", "math": "math_tasks.jsonl"}
MAX_NEW_TOKENS = {"code": 160, "math": 48}  # a short function; a number and a few words
TIMEOUT_S = 5.0
INSTRUCTIONS = {
    "code": "Reply with only the Python function in one ```python code block, no explanation.",
    "math": "Reply with only the final answer as a number.",
}
# runs before the model's code in the checker: no network for the code under test
_PRELUDE = """\
import socket as _socket


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in task checks")


_socket.socket.connect = _no_network
_socket.socket.connect_ex = _no_network
_socket.create_connection = _no_network
del _socket
"""


@dataclass(frozen=True)
class Task:
    """One problem: its text, and how an answer is checked (tests for code, a number for math)."""

    id: str
    kind: str  # one of KINDS
    prompt: str
    tests: str = ""  # code: asserts run after the model's code
    entry_point: str = ""  # code: the function the tests call
    answer: float | None = None  # math: the expected number
    solution: str = ""  # code: a reference solution (ours)


@dataclass(frozen=True)
class Check:
    """Whether an answer passed, and why not."""

    passed: bool
    reason: str = ""


def load_tasks(limit: int | None = None, kinds: Sequence[str] = KINDS) -> list[Task]:
    """The built-in problems: the first `limit` of each kind (None: all), code then math."""
    if limit is not None and limit < 0:
        raise ValueError(f"--tasks takes a number of problems per kind >= 0 (got {limit})")
    tasks: list[Task] = []
    for kind in kinds:
        if kind not in _FILES:
            raise ValueError(f"unknown task kind {kind!r}: choose from {', '.join(KINDS)}")
        text = resources.files("specdecode.data").joinpath("tasks", _FILES[kind]).read_text()
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        for row in rows[:limit]:
            tasks.append(
                Task(
                    id=row["id"],
                    kind=row["kind"],
                    prompt=row["prompt"],
                    tests=row.get("tests", ""),
                    entry_point=row.get("entry_point", ""),
                    answer=row.get("answer"),
                    solution=row.get("solution", ""),
                )
            )
    return tasks


def task_prompt(task: Task) -> str:
    """What the model is asked: the problem and how to answer it."""
    return f"{task.prompt}\n{INSTRUCTIONS[task.kind]}"


def extract_code(text: str) -> str:
    """The first fenced code block of `text` (```python or ```), else the whole text."""
    match = re.search(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", text, re.DOTALL)
    return match.group(1) if match else text


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_number(text: str) -> float | None:
    """The last number written in `text` (commas between digits allowed), or None."""
    found = _NUMBER.findall(text.replace("\u2212", "-"))  # a typographic minus too
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _limits(timeout_s: float):  # pragma: no cover - runs in the child process
    import resource  # Unix only (runs in the child process)

    cpu = math.ceil(timeout_s) + 1
    for name, value in (
        ("RLIMIT_CPU", cpu),
        ("RLIMIT_AS", 1 << 30),
        ("RLIMIT_FSIZE", 1 << 24),
    ):
        limit = getattr(resource, name, None)
        if limit is not None:
            with contextlib.suppress(ValueError, OSError):  # a limit the OS will not lower
                resource.setrlimit(limit, (value, value))


def run_code(code: str, tests: str, timeout_s: float = TIMEOUT_S) -> Check:
    """Run `code` then `tests` in a fresh Python process in a temporary folder; passes when it
    exits 0 within `timeout_s` seconds."""
    with tempfile.TemporaryDirectory(prefix="specdecode-task-") as folder:
        path = Path(folder) / "check.py"
        path.write_text(f"{_PRELUDE}\n{code}\n\n{tests}\n")
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "HOME": folder}
        options: dict[str, Any] = {}
        if os.name == "posix":
            options["preexec_fn"] = lambda: _limits(timeout_s)
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(path)],
                cwd=folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=timeout_s,
                check=False,
                **options,
            )
        except subprocess.TimeoutExpired:
            return Check(False, f"timed out after {timeout_s:g} s")
    if done.returncode == 0:
        return Check(True)
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return Check(False, lines[-1][:200] if lines else f"exit status {done.returncode}")


def check_answer(task: Task, text: str, timeout_s: float = TIMEOUT_S) -> Check:
    """Whether the model's `text` answers `task`."""
    if task.kind == "code":
        return run_code(extract_code(text), task.tests, timeout_s)
    number = extract_number(text)
    if number is None:
        return Check(False, "no number in the answer")
    if task.answer is None or not math.isclose(number, task.answer, rel_tol=1e-6, abs_tol=1e-9):
        return Check(False, f"answered {number:g}, expected {task.answer:g}")
    return Check(True)


def run_tasks(
    engine: Any,
    tasks: Sequence[Task],
    chat: bool = True,
    progress: bool = True,
    desc: str = "tasks",
) -> list[dict[str, Any]]:
    """Answer every task greedily with `engine` (a SpeculativeDecoder) and check it: one
    `{"id", "kind", "passed", "reason", "new_tokens"}` per task."""
    results = []
    for task in tqdm(tasks, desc=desc, unit="task", disable=not progress):
        out = engine.generate(
            task_prompt(task),
            max_new_tokens=MAX_NEW_TOKENS[task.kind],
            temperature=0.0,
            chat=chat,
        )
        check = check_answer(task, out.text or "")
        results.append(
            {
                "id": task.id,
                "kind": task.kind,
                "passed": check.passed,
                "reason": check.reason,
                "new_tokens": len(out.token_ids),
            }
        )
    return results


def pass_rates(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """{"all" | kind: {"passed", "total", "rate"}} over `results` (kinds with no task left out)."""
    out: dict[str, Any] = {}
    for name in ("all", *KINDS):
        chosen = [r for r in results if name == "all" or r["kind"] == name]
        if chosen:
            passed = sum(bool(r["passed"]) for r in chosen)
            out[name] = {"passed": passed, "total": len(chosen), "rate": passed / len(chosen)}
    return out
