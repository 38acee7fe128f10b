"""A batch file through `specdecode run-batch` against the same requests through `specdecode
serve` at N concurrent clients: total tokens/s side by side, and every answer compared.

`--requests` requests of mixed kinds, greedy: the built-in suite's prompts (every category) in
turn as Batch API chat requests, Batch API completions and plain `messages` lines, with
`max_tokens` cycling through 32, 48 and 64 (past the suite's 72 prompts, requests repeat earlier
ones; `--unique` opens each prompt with its own request number instead, so that no two share
more than the chat template's head). Both run the same engine options (`--target`,
`--draft`, `--max-batch`, the default measured policy) in a process of their own, one after the
other, never together; `serve` is loaded and healthy before its clock starts, and `run-batch`'s
time is its own summary's (the models' load excluded). An answer matches when its status, its
choices (text, finish reason) and its token counts equal the server's for the same body (the
speculative counters may differ: the measured policy's k follows each run's timings). Writes
OUT/requests.jsonl, OUT/run-batch.jsonl, OUT/serve.jsonl, OUT/summary.json and OUT/report.md.

    python -m benchmarks.run_batch_vs_serve --target qwen2.5-coder-1.5b-instruct:int4 \\
        --draft qwen2.5-coder-0.5b-instruct:int4 --out runs/run-batch
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from specdecode.data.suites import load_suite

MAX_TOKENS = (32, 48, 64)
SUMMARY = re.compile(r"this run: (\d+) requests in ([\d.]+) s, (\d+) tokens generated")


def make_requests(n: int, model: str, unique: bool = False) -> list[dict[str, Any]]:
    prompts = load_suite()
    lines = []
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        text, max_tokens = prompt.turns[0], MAX_TOKENS[i % len(MAX_TOKENS)]
        if unique:
            text = f"(request {i}) {text}"
        common = {"max_tokens": max_tokens, "temperature": 0}
        messages = [{"role": "user", "content": text}]
        custom_id = f"{i:03d}-{prompt.id}"
        if i % 3 == 0:
            body = {"model": model, "messages": messages, **common}
            url = "/v1/chat/completions"
        elif i % 3 == 1:
            body = {"model": model, "prompt": text, **common}
            url = "/v1/completions"
        else:
            lines.append({"custom_id": custom_id, "messages": messages, **common})
            continue
        lines.append({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
    return lines


def as_request(line: dict[str, Any], model: str) -> tuple[str, str, dict[str, Any]]:
    """(custom_id, url, body) as run-batch reads the line."""
    if "body" in line:
        return line["custom_id"], line["url"], line["body"]
    body = {k: v for k, v in line.items() if k != "custom_id"}
    return line["custom_id"], "/v1/chat/completions", {"model": model, **body}


def engine_args(args: argparse.Namespace) -> list[str]:
    out = ["--target", args.target, "--max-batch", str(args.max_batch)]
    return out + (["--draft", args.draft] if args.draft else [])


def run_batch(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    result = out / "run-batch.jsonl"
    result.unlink(missing_ok=True)
    command = ["specdecode", "run-batch", "--input", str(out / "requests.jsonl")]
    command += ["--output", str(result), "--quiet", *engine_args(args)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    (out / "run-batch.log").write_text(done.stderr)
    if done.returncode != 0:
        sys.exit(f"run-batch failed ({done.returncode}):\n{done.stderr[-2000:]}")
    found = SUMMARY.search(done.stderr)
    assert found, done.stderr[-2000:]
    answers = {}
    for line in result.read_text().splitlines():
        record = json.loads(line)
        answers[record["custom_id"]] = (
            record["response"]["status_code"],
            record["response"]["body"],
        )
    summary = [line for line in done.stderr.splitlines() if line.startswith(("run-batch:", "this"))]
    return {"seconds": float(found[2]), "wall_s": wall, "answers": answers, "summary": summary}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: argparse.Namespace, out: Path, requests: list[tuple[str, str, dict]]) -> dict:
    port = free_port()
    command = ["specdecode", "serve", *engine_args(args), "--port", str(port)]
    command += ["--log-level", "warning", "--queue-size", str(4 * args.clients)]
    log = (out / "serve.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                sys.exit(f"serve exited ({proc.returncode}): see {out / 'serve.log'}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit("serve did not come up in 15 minutes")
            time.sleep(1)
        work: queue.Queue = queue.Queue()
        for item in requests:
            work.put(item)
        answers: dict[str, tuple[int, Any]] = {}

        def client() -> None:
            with httpx.Client(base_url=base, timeout=None) as http:
                while True:
                    try:
                        custom_id, url, body = work.get_nowait()
                    except queue.Empty:
                        return
                    reply = http.post(url, json=body)
                    answers[custom_id] = (reply.status_code, reply.json())

        started = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()
    return {"seconds": seconds, "answers": answers}


def same(a: tuple[int, Any], b: tuple[int, Any]) -> bool:
    """Status, choices and token counts equal (ids, times and speculative counters aside)."""
    if a[0] != b[0]:
        return False
    if a[0] != 200:
        return a[1] == b[1]

    def key(body: dict) -> Any:
        usage = body["usage"]
        return body["choices"], usage["prompt_tokens"], usage["completion_tokens"]

    return key(a[1]) == key(b[1])


def tokens(answers: dict[str, tuple[int, Any]], field: str = "completion_tokens") -> int:
    return sum(body["usage"][field] for status, body in answers.values() if status == 200)


def kept(answers: dict[str, tuple[int, Any]]) -> int:
    """Prompt tokens a joining row took over from a freed one (the kept prefix)."""
    return sum(
        (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        for status, body in answers.values()
        if status == 200
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs, order alternating")
    parser.add_argument("--model-name", default=None, help="default: the target spec's name")
    parser.add_argument("--unique", action="store_true", help="no two prompts alike")
    parser.add_argument("--out", type=Path, default=Path("runs/run-batch"))
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = args.model_name or args.target  # the served name: the target's spec, as loaded
    lines = make_requests(args.requests, model, args.unique)
    (out / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = [as_request(line, model) for line in lines]

    batches, serves = [], []
    for round_ in range(args.rounds):  # A B, then B A: a drift of the machine hits both
        order = ("batch", "serve") if round_ % 2 == 0 else ("serve", "batch")
        for side in order:
            if side == "batch":
                batches.append(run_batch(args, out))
                print("\n".join(batches[-1]["summary"]), flush=True)
            else:
                serves.append(serve(args, out, requests))
                print(f"serve: {tokens(serves[-1]['answers'])} tokens in "
                      f"{serves[-1]['seconds']:.1f} s", flush=True)  # fmt: skip
    batch, served = batches[0], serves[0]
    with (out / "serve.jsonl").open("w") as f:
        for custom_id, _, _ in requests:
            status, body = served["answers"][custom_id]
            f.write(
                json.dumps({"custom_id": custom_id, "status_code": status, "body": body}) + "\n"
            )

    matched = [
        cid
        for cid, _, _ in requests
        if all(same(b["answers"][cid], s["answers"][cid]) for b in batches for s in serves)
    ]
    ok = sum(status == 200 for status, _ in batch["answers"].values())
    batch_rates = [tokens(b["answers"]) / b["seconds"] for b in batches]
    serve_rates = [tokens(s["answers"]) / s["seconds"] for s in serves]
    label = f"serve, {args.clients} clients"
    rates = {"run-batch": statistics.median(batch_rates), label: statistics.median(serve_rates)}
    from specdecode.auto.calibrate import cpu_identity

    cpu = cpu_identity()
    record = {
        "command": sys.argv,
        "cpu": cpu,
        "requests": len(requests),
        "answered_200": ok,
        "identical": len(matched),
        "run_batch": [{k: b[k] for k in ("seconds", "wall_s", "summary")} for b in batches],
        "serve_seconds": [s["seconds"] for s in serves],
        "tokens_per_s_each": {"run-batch": batch_rates, label: serve_rates},
        "tokens": {"run-batch": tokens(batch["answers"]), "serve": tokens(served["answers"])},
        "tokens_per_s": rates,
        "prompt_tokens": tokens(batch["answers"], "prompt_tokens"),
        "kept_prompt_tokens": {
            "run-batch": [kept(b["answers"]) for b in batches],
            "serve": [kept(s["answers"]) for s in serves],
        },
        "ratio": rates["run-batch"] / rates[label],
    }
    (out / "summary.json").write_text(json.dumps(record, indent=1))
    report = [
        f"# run-batch against serve ({len(requests)} requests, greedy)",
        "",
        f"`{' '.join(sys.argv)}`",
        "",
        f"CPU: {cpu['model name']} (family {cpu['cpu family']}, model {cpu['model']}), "
        f"{os.cpu_count()} cores. Target {args.target}, draft {args.draft}, max batch "
        f"{args.max_batch}.",
        "",
        f"Rounds: {args.rounds} (run-batch and serve alternating: A B, B A, ...); tokens/s "
        "per run, and the median.",
        "",
        "| run | tokens | tokens/s, each run | median |",
        "|---|---:|---|---:|",
        f"| run-batch | {tokens(batch['answers'])} | "
        f"{', '.join(f'{r:.1f}' for r in batch_rates)} | {rates['run-batch']:.1f} |",
        f"| {label} | {tokens(served['answers'])} | "
        f"{', '.join(f'{r:.1f}' for r in serve_rates)} | {rates[label]:.1f} |",
        "",
        f"run-batch / serve: **{record['ratio']:.2f}x**; answers identical to the server's: "
        f"{len(matched)}/{len(requests)} in every run ({ok} answered 200).",
        "",
        f"Prompt tokens kept from a freed row (of {record['prompt_tokens']}): run-batch "
        f"{', '.join(map(str, record['kept_prompt_tokens']['run-batch']))}; serve "
        f"{', '.join(map(str, record['kept_prompt_tokens']['serve']))}.",
        "",
        *batch["summary"],
    ]
    (out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
