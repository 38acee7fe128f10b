"""What benchmarks/llamacpp_kld.py sends to `llama-perplexity` and reads back, and its report.

Nothing here runs a model: the two command lines (the reference's log-probabilities saved with
`--kl-divergence-base`, then a model's KL divergence to them with `--kl-divergence`), the parsers
of the tool's output (the format of llama.cpp 0.5.0-dev, commit 0c1e570, tools/perplexity), the
reader of the file the first run writes (the token stream it scored and the reference's
log-probabilities, stored 16-bit), llama-perplexity's windows over a token stream, and the
markdown of a results dict. So the tests check all of it on captured output (tests/data/llamacpp/).

How llama-perplexity scores a text: it tokenizes the whole file once (BOS first where the vocabulary
adds one; special-token text such as `<|im_start|>` is read as plain text), cuts the tokens into
`n_chunk = len // n_ctx` chunks of `n_ctx` (the rest is dropped), puts BOS in each chunk's first
slot where the vocabulary adds one, and scores the second half of each chunk: the logits at
positions `n_ctx // 2 .. n_ctx - 2` against the next token, `n_ctx - 1 - n_ctx // 2` positions per
chunk. The saved reference keeps, per position, log-probabilities within 16 nats of the top one
(on 65535 steps); the KL divergence sums only the reference's tokens with log p > -16.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOOL = "llama-perplexity"
KLD_MAGIC = b"_logits_"
LOG_PROB_FLOOR = -16.0  # llama.cpp's KL divergence leaves out reference log-probs at or below it

# --------------------------------------------------------------------------------------------
# Command lines


def base_command(
    bin_dir: Path, gguf: Path, text: Path, kld_file: Path, ctx: int, threads: int
) -> list[str]:
    """llama-perplexity on the reference model: its perplexity, and every scored position's
    log-probabilities (and the token stream) saved to `kld_file`."""
    return [
        str(bin_dir / TOOL),
        *("-m", str(gguf), "-f", str(text), "--kl-divergence-base", str(kld_file)),
        *("-c", str(ctx), "-t", str(threads)),
    ]


def kld_command(
    bin_dir: Path, gguf: Path, text: Path, kld_file: Path, ctx: int, threads: int
) -> list[str]:
    """llama-perplexity on a quantized model against the saved reference: it reads the tokens
    from `kld_file` (the text is not tokenized again)."""
    return [
        str(bin_dir / TOOL),
        *("-m", str(gguf), "-f", str(text), "--kl-divergence-base", str(kld_file)),
        *("--kl-divergence", "-c", str(ctx), "-t", str(threads)),
    ]


# --------------------------------------------------------------------------------------------
# Parsing the tool's output (stdout and stderr together: the statistics go to one, the log to
# the other)

_NUM = r"(-?[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?|-?inf|nan)"
_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+)")
_FINAL = re.compile(r"Final estimate: PPL = " + _NUM + r" \+/- " + _NUM)
_STAT = re.compile(r"^\s*(.+?)\s*:\s*" + _NUM + r"\s*(?:±\s*" + _NUM + r")?\s*%?\s*$")
_VERSION = re.compile(r"version: (\S+) \(build (\d+), commit (\w+)\)")

# line label -> (key, scale): the percentages are read as fractions
_PPL_STATS = {
    "Mean PPL(Q)": ("perplexity", 1.0),
    "Mean PPL(base)": ("perplexity_base", 1.0),
    "Cor(ln(PPL(Q)), ln(PPL(base)))": ("ln_ppl_correlation", 0.01),
    "Mean ln(PPL(Q)/PPL(base))": ("ln_ppl_ratio", 1.0),
    "Mean PPL(Q)/PPL(base)": ("ppl_ratio", 1.0),
    "Mean PPL(Q)-PPL(base)": ("ppl_difference", 1.0),
}
_KLD_STATS = {
    "Mean    KLD": ("kld_mean", 1.0),
    "Maximum KLD": ("kld_max", 1.0),
    "99.9%   KLD": ("kld_p99_9", 1.0),
    "99.0%   KLD": ("kld_p99", 1.0),
    "95.0%   KLD": ("kld_p95", 1.0),
    "90.0%   KLD": ("kld_p90", 1.0),
    "Median  KLD": ("kld_median", 1.0),
    "Minimum KLD": ("kld_min", 1.0),
}
_TOKEN_STATS = {
    "Mean    Δp": ("delta_p_mean", 0.01),
    "RMS Δp": ("delta_p_rms", 0.01),
    "Same top p": ("top1_agreement", 0.01),
}


def parse_base(output: str) -> dict[str, Any]:
    """The reference run (`--kl-divergence-base` alone): its chunks, context and final
    perplexity ("Final estimate: PPL = X +/- Y"). ValueError naming what is missing."""
    chunks = _CHUNKS.search(output)
    final = _FINAL.search(output)
    if chunks is None or final is None:
        raise ValueError(
            f"{TOOL} printed no "
            + ("'calculating perplexity over N chunks' line" if chunks is None else "final PPL")
            + f" (too short a text gives neither); its output ends: {_tail(output)}"
        )
    return {
        "chunks": int(chunks.group(1)),
        "n_ctx": int(chunks.group(2)),
        "perplexity": float(final.group(1)),
        "perplexity_uncertainty": float(final.group(2)),
    }


def parse_kld(output: str) -> dict[str, Any]:
    """The `--kl-divergence` run's closing statistics: perplexity of the model and of the
    reference, KL divergence (mean ± uncertainty, percentiles, median), Δp and top-1
    agreement ("Same top p", as a fraction). ValueError when they are missing (llama.cpp
    prints none below 100 scored positions)."""
    chunks = _CHUNKS.search(output)
    sections = {
        "====== Perplexity statistics ======": _PPL_STATS,
        "====== KL divergence statistics ======": _KLD_STATS,
        "====== Token probability statistics ======": _TOKEN_STATS,
    }
    found: dict[str, Any] = {}
    table: dict[str, tuple[str, float]] = {}
    for line in output.splitlines():
        if line.strip() in sections:
            table = sections[line.strip()]
            continue
        match = _STAT.match(line)
        if match is None or not table:
            continue
        label = re.sub(r"\s+", " ", match.group(1))
        for name, (key, scale) in table.items():
            if re.sub(r"\s+", " ", name) == label:
                found[key] = round(float(match.group(2)) * scale, 10)
                if match.group(3) is not None:
                    found[key + "_uncertainty"] = round(float(match.group(3)) * scale, 10)
    needed = ("perplexity", "perplexity_base", "kld_mean", "kld_median", "kld_p99")
    missing = [key for key in (*needed, "top1_agreement") if key not in found]
    if missing or chunks is None:
        raise ValueError(
            f"{TOOL} --kl-divergence printed no {', '.join(missing) or 'chunk count'} "
            f"(it prints its statistics only past 100 scored positions); its output ends: "
            f"{_tail(output)}"
        )
    n_ctx = int(chunks.group(2))
    found["chunks"] = int(chunks.group(1))
    found["n_ctx"] = n_ctx
    found["tokens"] = found["chunks"] * scored_per_chunk(n_ctx)
    return found


def parse_version(text: str) -> dict[str, str]:
    """`llama-perplexity --version`: "version: 0.5.0-dev (build 1, commit 0c1e570)"."""
    match = _VERSION.search(text)
    if match is None:
        return {"version": text.strip().splitlines()[0] if text.strip() else "unknown"}
    return {"version": match.group(1), "build": match.group(2), "commit": match.group(3)}


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "(nothing)"


# --------------------------------------------------------------------------------------------
# The saved reference: "_logits_", n_ctx (uint32), n_vocab, n_chunk (int32), the tokens
# (n_chunk * n_ctx int32), then per chunk and scored position 2 float32 (scale, min) and
# n_vocab uint16 codes padded to an even count: log p = scale * code + min


@dataclass(frozen=True)
class KldFile:
    """The header of a `--kl-divergence-base` file and where its log-probabilities start."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # [n_chunk * n_ctx] int32: the stream llama.cpp scored, as it tokenized
    data_offset: int  # bytes

    @property
    def row_width(self) -> int:
        """uint16 per scored position: 4 (two float32) and the codes, padded to even."""
        return 2 * ((self.n_vocab + 1) // 2) + 4

    def log_probs(self, chunk: int) -> np.ndarray:
        """The reference's log-probabilities at chunk `chunk`'s scored positions:
        [n_ctx - 1 - n_ctx // 2, n_vocab] float32, decoded as llama.cpp decodes them."""
        if not 0 <= chunk < self.n_chunk:
            raise IndexError(f"chunk {chunk} of {self.n_chunk}")
        rows = scored_per_chunk(self.n_ctx)
        offset = self.data_offset + chunk * rows * self.row_width * 2
        codes = np.fromfile(self.path, dtype=np.uint16, count=rows * self.row_width, offset=offset)
        codes = codes.reshape(rows, self.row_width)  # [rows, 4 + padded V]
        head = codes[:, :4].copy().view(np.float32)  # [rows, 2]: scale, min log-prob
        scale, low = head[:, :1], head[:, 1:2]
        return scale * codes[:, 4 : 4 + self.n_vocab].astype(np.float32) + low


def read_kld_file(path: Path) -> KldFile:
    """The header and token stream of a `--kl-divergence-base` file; ValueError if it is not
    one or is cut short."""
    path = Path(path)
    with path.open("rb") as f:
        magic = f.read(8)
        if magic != KLD_MAGIC:
            raise ValueError(f"{path} is not a llama-perplexity log-probability file")
        head = np.frombuffer(f.read(12), dtype=np.int32)
        if head.size != 3:
            raise ValueError(f"{path}: header cut short")
        n_ctx, n_vocab, n_chunk = (int(v) for v in head)
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32)
    if tokens.size != n_ctx * n_chunk:
        raise ValueError(f"{path}: {tokens.size} tokens, expected {n_ctx * n_chunk}")
    data_offset = 8 + 12 + 4 * n_ctx * n_chunk
    kld = KldFile(path, n_ctx, n_vocab, n_chunk, tokens.copy(), data_offset)
    expected = data_offset + n_chunk * scored_per_chunk(n_ctx) * kld.row_width * 2
    if path.stat().st_size < expected:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, expected {expected}")
    return kld


# --------------------------------------------------------------------------------------------
# llama-perplexity's windows


def scored_per_chunk(n_ctx: int) -> int:
    """Positions scored per chunk: the second half of the window, less its last position."""
    return n_ctx - 1 - n_ctx // 2


def windows(
    tokens: Sequence[int], n_ctx: int, bos: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """llama-perplexity's chunks of `tokens` as (context, scored) pairs: context the chunk's
    first `n_ctx // 2 + 1` tokens (the first one `bos` where given), scored the rest, so that
    teacher-forcing context + scored predicts exactly the positions llama.cpp scores. The
    tokens past the last whole chunk are dropped, as llama.cpp drops them."""
    if n_ctx < 4:
        raise ValueError(f"a context of {n_ctx} tokens scores nothing")
    first = n_ctx // 2
    out = []
    for start in range(0, len(tokens) // n_ctx * n_ctx, n_ctx):
        chunk = [int(t) for t in tokens[start : start + n_ctx]]
        if bos is not None:
            chunk[0] = bos
        out.append((chunk[: first + 1], chunk[first + 1 :]))
    return out


def token_check(ours: Sequence[int], theirs: Sequence[int]) -> dict[str, Any]:
    """Whether llama.cpp's token stream (the scored chunks) is ours, token for token."""
    n = min(len(ours), len(theirs))
    first = next((i for i in range(n) if int(ours[i]) != int(theirs[i])), None)
    if first is None and len(theirs) > len(ours):
        first = n
    return {
        "ours": len(ours),
        "llama_cpp_scored": len(theirs),
        "identical": first is None,
        "first_difference": first,
    }


# --------------------------------------------------------------------------------------------
# The report


def _f(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


ROW_KEYS = ("kld_mean", "kld_median", "kld_p99", "top1_agreement", "perplexity")


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The comparison table: one row per measurement."""
    lines = [
        "| measurement | harness | reference | tokens | KL mean | KL median | KL p99 | top-1 | PPL |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['harness']} | {row['reference']} | {row['tokens']} | "
            f"{_f(row.get('kld_mean'), 5)} | {_f(row.get('kld_median'), 5)} | "
            f"{_f(row.get('kld_p99'), 4)} | {_f(row.get('top1_agreement'), 4)} | "
            f"{_f(row.get('perplexity'), 4)} |"
        )
    return "\n".join(lines)


def render_report(result: dict[str, Any]) -> str:
    """report.md from results.json's content."""
    config, machine, text = result["config"], result["machine"], result["text"]
    cpu = machine["cpu"]
    check = text["token_check"]
    llama = result["llama_cpp"]
    tokens_line = (
        f"llama.cpp's tokens are ours, token for token, over all {check['llama_cpp_scored']} "
        f"it scored (ours: {check['ours']} in the whole text)."
        if check["identical"]
        else f"**llama.cpp's tokens differ from ours** from token {check['first_difference']} "
        f"(ours {check['ours']}, llama.cpp's scored {check['llama_cpp_scored']}): our windows "
        "use llama.cpp's stream."
    )
    lines = [
        "# The int4 target's KL divergence beside llama.cpp's Q4_K_M, on the same text",
        "",
        f"Command: `{config['command']}`  ",
        f"Started {result['started']}, {result.get('minutes', 0):.1f} minutes.",
        "",
        f"- CPU: {cpu['model_name']} (family {cpu['family']}, model {cpu['model']}), "
        f"{machine['threads']} threads on both sides; flags: {', '.join(cpu['flags']) or '-'}",
        f"- llama.cpp {llama.get('version', '?')} (build {llama.get('build', '?')}, commit "
        f"{llama.get('commit', '?')}): `{config['llamacpp_bin']}`",
        f"- software: {', '.join(f'{k} {v}' for k, v in machine['versions'].items())}",
        f"- target `{config['target']}`: reference ours in bfloat16 and llama.cpp's "
        f"`{Path(config['base_gguf']).name}` (that bfloat16 folder converted by "
        f"convert_hf_to_gguf.py --outtype bf16); quantized ours `{config['target']}:int4`, "
        f"llama.cpp's `{Path(config['gguf']).name}`",
        f"- text: the bfloat16 target's greedy answers (at most {config['max_new_tokens']} new "
        f"tokens, chat template) to {text['prompts']} bench prompts (the first {config['limit']} "
        "scored ones of each category, as `specdecode compare --limit` scores them), written as "
        f"plain text, prompt then answer: {text['chars']} characters, {text['tokens']} tokens; "
        f"llama.cpp windows of -c {config['ctx']}: {llama['kld']['chunks']} chunks, "
        f"{llama['kld']['tokens']} scored positions",
        f"- {tokens_line}",
        "",
        table(result["rows"]),
        "",
        "- **llama.cpp windows**: llama-perplexity's chunks of -c tokens, the second half of "
        "each scored (prompt and answer text alike, whatever the chunk holds); ours teacher-forced "
        "over exactly llama.cpp's token stream and windows. `floor -16`: the KL divergence summed, "
        "as llama.cpp sums it, over the reference tokens with log p > -16 only.",
        "- **per prompt (compare)**: as `specdecode compare` scores: each prompt in our chat "
        "template, its answer teacher-forced, the answer's tokens scored.",
        "- Reference `llama.cpp bf16`: the log-probabilities llama.cpp saved from the bfloat16 "
        "GGUF (16-bit, within 16 nats of the top); `ours bf16`: our bfloat16 target's.",
        "",
    ]
    per_category = result.get("ours_per_category") or {}
    if per_category:
        cats = [c for c in next(iter(per_category.values())) if c != "all"]
        lines += [
            "## Per prompt (compare), per category (KL mean / top-1)",
            "",
            "| variant | " + " | ".join(cats) + " |",
            "|---|" + "---|" * len(cats),
        ]
        for variant, stats in per_category.items():
            cells = [
                f"{_f(stats[c].get('kld_mean'), 4)} / {_f(stats[c].get('top1_agreement'), 2)}"
                for c in cats
            ]
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"
