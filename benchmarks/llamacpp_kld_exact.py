"""Each side's bfloat16 and 4-bit model against the same weights in float32, on llama.cpp's windows.

    python -m benchmarks.llamacpp_kld_exact --llamacpp-bin ~/llama.cpp/build/bin --chunks 2 \\
        --out runs/kld-exact

After benchmarks/llamacpp_kld.py (never in CI; builds nothing): it reads that run's `--work`
folder (reference.txt, base.kld: llama.cpp's bfloat16 log-probabilities and token stream) and
asks where each side's distance comes from. The reference here is our target computed in
float32 from the same bfloat16 weights (the arithmetic as exact as this machine does it), over the
first `--chunks` of llama.cpp's windows; against it, with llama.cpp's sum (reference log p > -16):

- ours bf16 (the reference of `specdecode compare`) and ours `:int4` as they run;
- `:int4`'s weights in float32 arithmetic (its linears' PyTorch path: the same 4-bit and int8
  weights, no 8-bit activations, no bfloat16 hidden states): the weights' own share;
- llama.cpp's bfloat16 GGUF (base.kld) and its Q4_K_M file, whose log-probabilities one more
  `llama-perplexity --kl-divergence-base --chunks N` saves (into `--work`/quantized.kld).

Writes exact.json and exact.md under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks import llamacpp_kld as kld_run
from benchmarks import llamacpp_kld_io as kio
from specdecode.bench.quality import answer_log_probs, summarize_tokens, token_quality
from specdecode.models.fetch import rebuild_gguf
from specdecode.models.loading import load_model

QUANTIZED_KLD = "quantized.kld"
NAMES = {
    "ours_bf16": "ours bf16",
    "ours_int4": "ours int4 (as it runs)",
    "ours_int4_weights_fp32": "ours int4 weights, float32 arithmetic",
    "llama_bf16": "llama.cpp bf16",
    "llama_q4_k_m": "llama.cpp Q4_K_M",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-bin", type=Path, required=True, metavar="DIR")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument(
        "--gguf", type=Path, default=None, help="the quantized GGUF (default: the preset's)"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/kld"), metavar="DIR")
    parser.add_argument("--chunks", type=int, default=2, help="windows scored (default 2)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args(argv)
    if args.chunks < 1:
        parser.error("--chunks must be at least 1")
    if not (args.llamacpp_bin / kio.TOOL).is_file():
        parser.error(f"--llamacpp-bin {args.llamacpp_bin}: no {kio.TOOL} there")
    for name in (kld_run.TEXT, kld_run.BASE_KLD):
        if not (args.work / name).is_file():
            parser.error(f"no {args.work / name}: run benchmarks/llamacpp_kld.py first")
    return args


def log_probs_per_chunk(
    model: Any, chunks: list[tuple[list[int], list[int]]], what: str
) -> Iterator[torch.Tensor]:
    """Each chunk's scored log-probabilities [T, V], one at a time."""
    for context, scored in tqdm(chunks, desc=what, leave=False):
        yield answer_log_probs(model, context, scored)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    base = kio.read_kld_file(args.work / kld_run.BASE_KLD)
    n = min(args.chunks, base.n_chunk)
    chunks = kio.windows(base.tokens, base.n_ctx)[:n]  # a BOS-free vocabulary (checked below)

    quant_gguf = args.gguf or rebuild_gguf(args.target)
    if kld_run.gguf_add_bos(quant_gguf):
        raise SystemExit("llamacpp_kld_exact: a vocabulary that adds BOS is not handled here")
    q_path = args.work / QUANTIZED_KLD
    text = args.work / kld_run.TEXT
    saved = kio.base_command(args.llamacpp_bin, quant_gguf, text, q_path, base.n_ctx, threads)
    command = [*saved, "--chunks", str(n)]
    kld_run.call(command, args.timeout)
    quantized = kio.read_kld_file(q_path)
    if quantized.tokens.tolist() != base.tokens[: quantized.tokens.size].tolist():
        raise SystemExit("llamacpp_kld_exact: the two llama.cpp runs scored different tokens")

    exact = load_model(args.target, dtype="float32", role="target")
    reference = list(log_probs_per_chunk(exact.model, chunks, "float32 reference"))
    del exact
    parts: dict[str, list] = {name: [] for name in NAMES}

    def score(name: str, chunk: int, log_probs: torch.Tensor) -> None:
        ref, scored = reference[chunk], chunks[chunk][1]
        width = min(ref.shape[1], log_probs.shape[1])
        parts[name].append(
            token_quality(ref[:, :width], log_probs[:, :width], scored, floor=kio.LOG_PROB_FLOOR)
        )

    for chunk in range(n):
        score("llama_bf16", chunk, torch.from_numpy(base.log_probs(chunk)))
        score("llama_q4_k_m", chunk, torch.from_numpy(quantized.log_probs(chunk)))
    model = load_model(args.target, role="target")
    for chunk, log_probs in enumerate(log_probs_per_chunk(model.model, chunks, "ours bf16")):
        score("ours_bf16", chunk, log_probs)
    del model
    model = load_model(f"{args.target}:int4", role="target")
    for chunk, log_probs in enumerate(log_probs_per_chunk(model.model, chunks, "ours int4")):
        score("ours_int4", chunk, log_probs)
    model.model.float()  # the quantized linears take their PyTorch path on float32 inputs
    fp32 = log_probs_per_chunk(model.model, chunks, "int4 weights, float32")
    for chunk, log_probs in enumerate(fp32):
        score("ours_int4_weights_fp32", chunk, log_probs)
    del model
    stats = {name: summarize_tokens(p) for name, p in parts.items()}
    result = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "minutes": (time.time() - started) / 60,
        "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(argv),
        "llama_command": command,
        "chunks": n,
        "n_ctx": base.n_ctx,
        "machine": kld_run.machine(threads),
        "against_float32": stats,
    }
    (args.out / "exact.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Against the same weights in float32 (llama.cpp's windows)",
        "",
        f"Command: `{result['command']}`; {n} windows of {base.n_ctx} tokens, "
        f"{stats['ours_bf16']['tokens']} scored positions; {result['minutes']:.1f} minutes.",
        "",
        "| model | KL mean | KL median | KL p99 | top-1 | PPL |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in stats.items():
        lines.append(
            f"| {NAMES[name]} | {s['kld_mean']:.5f} | {s['kld_median']:.5f} | "
            f"{s['kld_p99']:.4f} | {s['top1_agreement']:.4f} | {s['perplexity']:.4f} |"
        )
    report = "\n".join(lines) + "\n"
    (args.out / "exact.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
