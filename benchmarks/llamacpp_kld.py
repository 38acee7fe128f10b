"""Our int4 target's KL divergence to bfloat16 beside llama.cpp's Q4_K_M, on the same text.

    python -m benchmarks.llamacpp_kld --llamacpp-bin ~/llama.cpp/build/bin --out runs/kld

Never run in CI and builds nothing: `--llamacpp-bin` is the folder of an already built llama.cpp
(llama-perplexity). In order:

1. The reference text, as `specdecode compare` makes it: the bfloat16 target's greedy answers to
   the bench prompts it scores (the first `--limit` of each category, the last
   `--calibration-prompts` held out), cached with the model; written as plain text, each
   prompt then its answer (llama-perplexity reads special tokens as text, so no chat template).
2. llama.cpp's reference: the preset's bfloat16 folder converted to a GGUF by llama.cpp's
   convert_hf_to_gguf.py (`--outtype bf16`, into `--work`, once; it needs `sentencepiece`
   importable) and `llama-perplexity --kl-divergence-base` on the text (its log-probabilities,
   and the token stream it scored, saved to `--work`/base.kld).
3. `llama-perplexity --kl-divergence` of the Q4_K_M file (the preset's own GGUF) against it.
4. Ours over exactly llama.cpp's token stream and windows (llamacpp_kld_io.windows): `MODEL:int4`
   against our bfloat16 target, against llama.cpp's saved bfloat16 log-probabilities too, and our
   bfloat16 against llama.cpp's (how far the two references are apart).
5. Ours as `specdecode compare` scores (bench/quality.py): per prompt, in our chat template, the
   answer's tokens only.

Writes results.json, report.md and llama-perplexity's own output (llama_base.log,
llama_kld.log) under `--out` and prints the report. `--clean` removes the
big files it wrote in `--work` (the bfloat16 GGUF, base.kld) at the end; a later run makes them
again. Definitions: the report and lab/benchmarks.md ("Speculation vs quantization vs pruning").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks import llamacpp_io as lio
from benchmarks import llamacpp_kld_io as kio
from specdecode.bench.compare import split_prompts
from specdecode.bench.quality import (
    answer_log_probs,
    measure_quality,
    summarize_tokens,
    token_quality,
)
from specdecode.bench.variants import calibration_cache, calibration_sequences
from specdecode.data.suites import load_suite
from specdecode.models.fetch import cached_path, rebuild_gguf
from specdecode.models.loading import load_model
from specdecode.runtime.engine import SpeculativeDecoder

BASE_KLD = "base.kld"
TEXT = "reference.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llamacpp-bin",
        type=Path,
        required=True,
        metavar="DIR",
        help=f"folder of llama.cpp's built tools ({kio.TOOL})",
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target preset")
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the quantized GGUF llama.cpp scores (default: the preset's, `specdecode models gguf`)",
    )
    parser.add_argument(
        "--base-gguf",
        type=Path,
        default=None,
        help="llama.cpp's bfloat16 reference (default: WORK/TARGET-bf16.gguf, converted from the "
        "preset's folder when missing)",
    )
    parser.add_argument(
        "--convert-script",
        type=Path,
        default=None,
        help="llama.cpp's convert_hf_to_gguf.py (default: two folders above --llamacpp-bin)",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/kld"), metavar="DIR")
    parser.add_argument("--ctx", type=int, default=512, help="llama-perplexity -c (default 512)")
    parser.add_argument("--limit", type=int, default=3, help="scored prompts per category")
    parser.add_argument("--calibration-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"threads for both sides (default: torch's, {torch.get_num_threads()} here)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per llama.cpp call")
    parser.add_argument("--clean", action="store_true", help="remove the big files in --work after")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args(argv)
    if args.ctx < 16 or args.ctx % 2:
        parser.error(f"--ctx: an even number of at least 16 tokens (got {args.ctx})")
    for name in ("limit", "calibration_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (args.llamacpp_bin / kio.TOOL).is_file():
        parser.error(f"--llamacpp-bin {args.llamacpp_bin}: no {kio.TOOL} there (build llama.cpp)")
    args.convert_script = args.convert_script or (
        args.llamacpp_bin.resolve().parents[1] / "convert_hf_to_gguf.py"
    )
    if args.base_gguf is None and not args.convert_script.is_file():
        parser.error(
            f"no {args.convert_script}: give --convert-script (llama.cpp's convert_hf_to_gguf.py) "
            "or --base-gguf"
        )
    for flag, path in (("--gguf", args.gguf), ("--base-gguf", args.base_gguf)):
        if path is not None and not path.is_file():
            parser.error(f"{flag} {path}: no such file")
    return args


def call(command: list[str], timeout: float) -> str:
    """Run one command; its stdout and stderr together (RuntimeError when it fails)."""
    print("$ " + " ".join(command), file=sys.stderr)
    proc = lio.run_tool(command, timeout)
    return proc.stdout + "\n" + proc.stderr


def gguf_add_bos(path: Path) -> bool | None:
    """The file's `tokenizer.ggml.add_bos_token` (None where it does not say)."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.contents())


def reference_text(
    reference: Any, args: argparse.Namespace
) -> tuple[str, list[tuple[str, list[int], list[int]]]]:
    """The plain text llama.cpp reads, and (category, prompt ids, answer ids) per prompt as
    `specdecode compare` scores them (chat template)."""
    prompts, _ = split_prompts(load_suite(None), args.calibration_prompts, args.limit)
    sequences = calibration_sequences(
        reference, prompts, args.max_new_tokens, chat=True, cache=calibration_cache()
    )
    engine = SpeculativeDecoder(reference, generation_config="none")
    texts, parts = [], []
    for prompt, sequence in zip(prompts, sequences, strict=True):
        ids = engine.encode_prompt(prompt.turns[0], chat=True)
        answer = sequence[len(ids) :]
        texts.append((prompt.category, ids, answer))
        answer_text = reference.tokenizer.decode(answer, skip_special_tokens=True).strip()
        parts.append(f"{prompt.turns[0].strip()}\n\n{answer_text}")
    return "\n\n".join(parts), texts


def ours_in_windows(
    reference: Any, quantized: Any, kld: kio.KldFile, bos: int | None
) -> dict[str, dict[str, Any]]:
    """Ours teacher-forced over llama.cpp's chunks: int4 against our bf16 (all tokens, and as
    llama.cpp sums: reference log p > -16), int4 and our bf16 against llama.cpp's saved bf16."""
    pairs = {
        "int4 | ours bf16": [],
        "int4 | ours bf16, floor": [],
        "int4 | llama.cpp bf16": [],
        "ours bf16 | llama.cpp bf16": [],
    }
    chunks = kio.windows(kld.tokens, kld.n_ctx, bos)
    for chunk, (context, scored) in enumerate(tqdm(chunks, desc="ours, llama.cpp's windows")):
        ref = answer_log_probs(reference.model, context, scored)  # [T, V]
        q = answer_log_probs(quantized.model, context, scored)  # [T, V]
        base = torch.from_numpy(kld.log_probs(chunk))  # [T, V'] llama.cpp's bf16
        width = base.shape[1]
        if width > ref.shape[1]:
            raise SystemExit(f"llama.cpp's vocabulary ({width}) is wider than ours")
        pairs["int4 | ours bf16"].append(token_quality(ref, q, scored))
        pairs["int4 | ours bf16, floor"].append(
            token_quality(ref, q, scored, floor=kio.LOG_PROB_FLOOR)
        )
        pairs["int4 | llama.cpp bf16"].append(
            token_quality(base, q[:, :width], scored, floor=kio.LOG_PROB_FLOOR)
        )
        pairs["ours bf16 | llama.cpp bf16"].append(
            token_quality(base, ref[:, :width], scored, floor=kio.LOG_PROB_FLOOR)
        )
    return {name: summarize_tokens(parts) for name, parts in pairs.items()}


def rows(
    llama_kld: dict[str, Any], base: dict[str, Any], windows: dict[str, Any], compare: dict
) -> list[dict[str, Any]]:
    """The report's table."""
    lw, per_prompt = "llama.cpp windows", "per prompt (compare)"
    llama_bf16 = {"tokens": llama_kld["tokens"], "perplexity": base["perplexity"]}

    def row(name: str, harness: str, reference: str, stats: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "harness": harness, "reference": reference} | {
            k: stats.get(k) for k in ("tokens", *kio.ROW_KEYS)
        }

    return [
        row("llama.cpp Q4_K_M", "llama-perplexity", "llama.cpp bf16", llama_kld),
        row("ours int4", lw, "ours bf16", windows["int4 | ours bf16"]),
        row("ours int4 (floor -16)", lw, "ours bf16", windows["int4 | ours bf16, floor"]),
        row("ours int4 (floor -16)", lw, "llama.cpp bf16", windows["int4 | llama.cpp bf16"]),
        row("ours bf16 (floor -16)", lw, "llama.cpp bf16", windows["ours bf16 | llama.cpp bf16"]),
        row("llama.cpp bf16 (its PPL)", "llama-perplexity", "-", llama_bf16),
        row("ours int4", per_prompt, "ours bf16", compare["int4"]["all"]),
        row("ours bf16 (its PPL)", per_prompt, "-", compare["bf16"]["all"]),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    version = kio.parse_version(call([str(args.llamacpp_bin / kio.TOOL), "--version"], 60))

    reference = load_model(args.target, role="target")
    folder = cached_path(args.target)
    if folder is None:
        raise SystemExit(f"llamacpp_kld: --target {args.target} is not a cached preset")
    quant_gguf = args.gguf or rebuild_gguf(args.target)
    created = []
    base_gguf = args.base_gguf or args.work / f"{args.target}-bf16.gguf"
    if not base_gguf.is_file():
        convert = [sys.executable, str(args.convert_script), str(folder)]
        call([*convert, "--outtype", "bf16", "--outfile", str(base_gguf)], args.timeout)
    if args.base_gguf is None:
        created.append(base_gguf)  # ours to remove with --clean

    text, texts = reference_text(reference, args)
    text_path = args.work / TEXT
    text_path.write_text(text)
    ours_tokens = reference.tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ours_tokens) < 2 * args.ctx:
        raise SystemExit(
            f"llamacpp_kld: the text is {len(ours_tokens)} tokens, llama-perplexity needs at "
            f"least 2 x --ctx = {2 * args.ctx}: raise --limit or lower --ctx"
        )

    kld_path = args.work / BASE_KLD
    created.append(kld_path)
    base_out = call(
        kio.base_command(args.llamacpp_bin, base_gguf, text_path, kld_path, args.ctx, threads),
        args.timeout,
    )
    (args.out / "llama_base.log").write_text(base_out)  # the tool's own output, kept
    base = kio.parse_base(base_out)
    kld = kio.read_kld_file(kld_path)
    q_out = call(
        kio.kld_command(args.llamacpp_bin, quant_gguf, text_path, kld_path, args.ctx, threads),
        args.timeout,
    )
    (args.out / "llama_kld.log").write_text(q_out)
    llama_kld = kio.parse_kld(q_out)
    add_bos = {"base": gguf_add_bos(base_gguf), "quantized": gguf_add_bos(quant_gguf)}
    if bool(add_bos["base"]) != bool(add_bos["quantized"]):
        raise SystemExit(f"llamacpp_kld: the two GGUF files disagree on add_bos_token: {add_bos}")
    bos = reference.tokenizer.bos_token_id if add_bos["quantized"] else None

    quantized = load_model(f"{args.target}:int4", role="target")
    windows = ours_in_windows(reference, quantized, kld, bos)
    compare = measure_quality(
        reference.model, {"bf16": reference.model, "int4": quantized.model}, texts
    )
    result = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "minutes": (time.time() - started) / 60,
        "config": {
            "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(argv),
            "llamacpp_bin": str(args.llamacpp_bin),
            "target": args.target,
            "gguf": str(quant_gguf),
            "base_gguf": str(base_gguf),
            "ctx": args.ctx,
            "limit": args.limit,
            "calibration_prompts": args.calibration_prompts,
            "max_new_tokens": args.max_new_tokens,
            "commands": {
                "base": kio.base_command(
                    args.llamacpp_bin, base_gguf, text_path, kld_path, args.ctx, threads
                ),
                "kld": kio.kld_command(
                    args.llamacpp_bin, quant_gguf, text_path, kld_path, args.ctx, threads
                ),
            },
            "add_bos": add_bos,
        },
        "machine": lio.machine(threads),
        "llama_cpp": version | {"base": base, "kld": llama_kld},
        "ours_kernels": {"bf16": reference.kernel, "int4": quantized.kernel},
        "text": {
            "prompts": len(texts),
            "chars": len(text),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "tokens": len(ours_tokens),
            "answer_tokens": sum(len(a) for _, _, a in texts),
            "token_check": kio.token_check(ours_tokens, kld.tokens.tolist()),
        },
        "ours_windows": windows,
        "ours_per_category": compare,
        "rows": rows(llama_kld, base, windows, compare),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    report = kio.render_report(result)
    (args.out / "report.md").write_text(report)
    print(report)
    if args.clean:
        for path in created:
            path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
