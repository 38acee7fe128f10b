"""A stand-in for vLLM's OpenAI server, for tests that start "vLLM" without vLLM.

`install(root)` writes a module at vLLM's path (`vllm.entrypoints.openai.api_server`) under
`root`; put `root` on PYTHONPATH and run it with this very Python (`VllmServer(sys.executable,
..., env={"PYTHONPATH": root})`). It takes vLLM's arguments, starts a child process as vLLM
starts its engine core, and serves `/health`, `/v1/models`, streamed `/v1/chat/completions`
(the same answer for every request, TOKENS chunks) and `/metrics`. With a speculative config it
counts vLLM's speculative counters (each request: 2 steps drafting k tokens each, 3 accepted);
without one it exports no speculative counters.
Served names fail on purpose: `refused` exits with a ValueError line, `never` never serves; a
proposer class whose name holds `Refused` is refused the same way.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

TOKENS = 6
SECONDS_PER_TOKEN = 0.01

STAND_IN = """
import argparse, json, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
for name in ("--model", "--served-model-name", "--host", "--port", "--speculative-config"):
    parser.add_argument(name)
args, _ = parser.parse_known_args()
spec = json.loads(args.speculative_config) if args.speculative_config else None
print("INFO starting", json.dumps(vars(args)), flush=True)
if args.served_model_name == "refused" or "Refused" in (spec or {}).get("model", ""):
    print("ValueError: this speculative config is refused", flush=True)
    sys.exit(1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("CHILD", child.pid, flush=True)
if args.served_model_name == "never":
    time.sleep(600)

pause = @SECONDS@  # between chunks, so that a stream takes some time
lock = threading.Lock()
counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass

    def reply(self, body, kind="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        if self.path == "/health":
            return self.reply("")
        if self.path == "/v1/models":
            return self.reply(json.dumps({"data": [{"id": args.served_model_name}]}))
        if self.path == "/metrics":
            if spec is None:
                return self.reply("vllm:num_requests_running 0\\n", "text/plain")
            with lock:
                return self.reply("".join(
                    f'vllm:spec_decode_num_{n}_total{{model_name="{args.served_model_name}"}} {v}\\n'
                    for n, v in counts.items()), "text/plain")
        self.send_response(404)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(@TOKENS@):
            time.sleep(pause)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": @TOKENS@}}
        self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())
        if spec is not None:
            with lock:
                k = spec["num_speculative_tokens"]
                counts["drafts"] += 2
                counts["draft_tokens"] += 2 * k
                counts["accepted_tokens"] += 3

ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
""".replace("@SECONDS@", repr(SECONDS_PER_TOKEN)).replace("@TOKENS@", repr(TOKENS))


def install(root: Path) -> Path:
    """The stand-in under `root` (vllm/entrypoints/openai/api_server.py); returns `root`."""
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True, exist_ok=True)
    for folder in (root / "vllm", root / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(textwrap.dedent(STAND_IN))
    return root
