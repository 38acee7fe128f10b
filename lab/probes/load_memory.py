"""What loading a model costs the process: wall time, the weights it holds, and its memory.

Each spec loads in a fresh Python process (a process's peak memory only grows), as a target
(`load_model(spec)`) or as a draft (`--role draft`: `resolve_draft`, which frees a quantized
draft's bfloat16 weights too), and prints one row: seconds to load, the weights and buffers the model
holds (`bench.memory.weights_bytes`), the process's resident memory after loading (VmRSS, and
RssAnon / RssFile: its own pages and pages mapped from files) and its peak (VmHWM, loading
included), all in GiB, beside the process's resident memory before loading. Not a timing
benchmark (one load each); run alone:

    python lab/probes/load_memory.py qwen2.5-coder-1.5b-instruct qwen2.5-coder-1.5b-instruct:int4
    python lab/probes/load_memory.py --role draft qwen2.5-coder-0.5b-instruct:int4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
GIB = 2**30


def status() -> dict[str, float]:
    """This process's memory lines from /proc/self/status, in GiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024 / GIB
    return out


def measure(spec: str, role: str) -> dict[str, object]:
    """Load `spec` here (in this process) and say what it cost."""
    import gc
    import time

    from specdecode.bench.memory import weights_bytes
    from specdecode.drafters import resolve_draft
    from specdecode.models.loading import load_model

    before = status()["VmRSS"]
    start = time.perf_counter()
    loaded = resolve_draft(spec, None) if role == "draft" else load_model(spec)
    seconds = time.perf_counter() - start
    gc.collect()
    return {
        "spec": spec,
        "role": role,
        "load_s": round(seconds, 2),
        "weights_gib": round(weights_bytes(loaded.model) / GIB, 3),
        "before_gib": round(before, 3),
        **{f"{k}_gib": round(v, 3) for k, v in status().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="model specs (a preset, a folder, ...:int4)")
    parser.add_argument("--role", choices=("target", "draft"), default="target")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.specs[0], args.role)))
        return
    columns = ["spec", "role", "load_s", "weights_gib", "before_gib", *(f"{k}_gib" for k in FIELDS)]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for spec in args.specs:
        child = [sys.executable, __file__, "--one", "--role", args.role, spec]
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print("| " + " | ".join(str(row[c]) for c in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
