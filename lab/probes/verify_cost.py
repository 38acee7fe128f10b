"""Measure v(n): the target's forward time over n new tokens / over 1 token, after a cached prefix.

    python lab/probes/verify_cost.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16

Speculative decoding pays only when verifying k+1 tokens costs about as much as one token; this
prints the ratio on the machine at hand (median of several repeats, after a warm-up), measured
in alternating rounds in one process, for each of `--kernels`:
  off        plain PyTorch linear layers and SDPA attention
  on         specdecode's bfloat16 CPU kernel and its decode attention (what `--kernel on` gives)
  on-sdpa    the kernel's linears with SDPA attention (the decode attention's share)
  on-rows    the kernel with every weight row-major (its row tiles, no packed panels)
  on-fma     the kernel's bfloat16 panels on AVX2 FMAs where the CPU has AVX-512 BF16 (which
             `on` uses there)
  int8       int8 weights on the kernel, decode attention (what a `MODEL:int8` draft runs)
  int8-sdpa  int8 weights with SDPA attention
  int8-avx2  int8 with its tile on AVX2 where the CPU has AVX-512 F (which `int8` uses there;
             the same results)
  int4       4-bit weights on the kernel (groups of 32; a tied output layer int8), decode attention
  int4-avx2  int4 with its tile on AVX2 where the CPU has AVX-512 VNNI (which `int4` uses there;
             the same results)
  MODE-lean  MODE (on or int8) through the lean forward (lean.py) instead of the
             model's own forward: what a drafter runs
  MODE@D     MODE with the AVX-512 BF16 panels prefetching D elements ahead (default 2048;
             speed only, the same results), e.g. on@2048,on@8192 (on@8192-lean with -lean)
"/ eager 1" divides by plain PyTorch's one-token forward: the cost that matters against decoding
without the kernel.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from specdecode.auto.costs import forward_seconds
from specdecode.core.cache import KVCache
from specdecode.kernels.attention import restore_attention, use_decode_attention
from specdecode.kernels.build import (
    DEFAULT_PREFETCH,
    bf16_dot_prefetch,
    use_bf16_dot,
    use_int4_vnni,
    use_int8_avx512,
)
from specdecode.kernels.cpu import BF16_AVX2, int4_name, int8_name
from specdecode.kernels.cpu_linear import apply_kernel, swap_linears
from specdecode.kernels.quantize import quantize_linears
from specdecode.models.lean import LeanCache
from specdecode.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="1,2,3,5,9")
    parser.add_argument("--prefix", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per kernel")
    parser.add_argument(
        "--kernels",
        default="off,on",
        help="modes: off,on,on-sdpa,on-rows,on-fma,int8,int8-sdpa,int4,int4-avx2, MODE-lean, MODE@D",
    )
    args = parser.parse_args()

    model = load_model(args.model, dtype=args.dtype, device="cpu", kernel="off").model
    sizes = sorted({1, *(int(n) for n in args.tokens.split(","))})
    modes = [m.strip() for m in args.kernels.split(",") if m.strip()]
    runs: dict[str, list[dict[int, float]]] = {m: [] for m in modes}
    names: dict[str, str] = {}
    for _ in range(args.rounds):
        for mode in modes:
            lean = mode.endswith("-lean")
            names[mode] = setup(model, mode.removesuffix("-lean")) + (" lean" if lean else "")
            cache_type = LeanCache if lean else KVCache
            runs[mode].append(
                forward_seconds(model, sizes, args.prefix, args.repeats, cache_type=cache_type)
            )
    seconds = {m: {n: statistics.median(r[n] for r in runs[m]) for n in sizes} for m in modes}
    eager_one = seconds.get("off", seconds[modes[0]])[1]
    print(
        f"{args.model}, {args.dtype}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print("| linears | new tokens | forward ms | v = ms / one-token ms | ms / eager one-token ms |")
    print("|---|---|---|---|---|")
    for mode in dict.fromkeys(modes):  # a mode given twice (A,B,B,A order) is one row set
        for n in sizes:
            ms = seconds[mode][n]
            print(
                f"| {names[mode]} | {n} | {ms * 1000:.0f} | {ms / seconds[mode][1]:.2f} "
                f"| {ms / eager_one:.2f} |"
            )


def setup(model: torch.nn.Module, mode: str) -> str:
    """Put `model` in `mode` (see the module's doc); returns a name for the table."""
    mode, at, distance = mode.partition("@")
    if at:
        if not distance.isdigit() or int(distance) < 1:
            raise SystemExit(f"{mode}@{distance}: a prefetch distance in elements, e.g. on@2048")
        name = setup(model, mode)
        bf16_dot_prefetch(int(distance))
        return f"{name} prefetch {distance}"
    modes = (
        "off",
        "on",
        "on-sdpa",
        "on-rows",
        "on-fma",
        "int8",
        "int8-sdpa",
        "int8-avx2",
        "int4",
        "int4-avx2",
    )
    if mode not in modes:
        raise SystemExit(f"unknown mode {mode!r}: {', '.join(modes)}, or one of them + -lean")
    apply_kernel(model, "off")  # from a clean model every time (int8 copies are dropped)
    if mode == "off":
        return "eager"
    bf16_dot_prefetch(DEFAULT_PREFETCH)  # for every kernel mode without @D
    use_bf16_dot(mode != "on-fma")  # process-wide switches: set for every kernel mode
    use_int4_vnni(mode != "int4-avx2")
    int8_avx512 = use_int8_avx512(mode != "int8-avx2")
    if mode == "on-rows":
        swap_linears(model, panels=False)
        use_decode_attention(model)
        return BF16_AVX2 + " rows"  # the row tiles run on AVX2 only
    name = apply_kernel(model, "on")  # says what the panels run on
    if mode.startswith("int8"):
        quantize_linears(model)
        name = int8_name(int8_avx512)
    elif mode.startswith("int4"):
        quantize_linears(model, bits=4)
        name = int4_name(use_int4_vnni(mode == "int4"))
    if mode.endswith("-sdpa"):
        restore_attention(model)
        name += " + sdpa"
    return name


if __name__ == "__main__":
    main()
