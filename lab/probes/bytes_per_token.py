"""Bytes a one-token forward of a model reads, from the model as loaded (no timing).

    python lab/probes/bytes_per_token.py qwen2.5-coder-1.5b-instruct:int4 \
        qwen2.5-coder-0.5b-instruct:int4 --role target --role draft

A decoded token reads every linear layer's weights as the kernel holds them (4-bit, 6-bit or
int8 panels with their scales, or bfloat16 panels), the norms and biases, and one row of the
input embedding (not the table: a lookup); a draft's output layer only its draft vocabulary's
rows (`--draft-vocab`, as a draft is loaded to decode). Per model this sums, per kind of
buffer, the bytes of every module's parameters and buffers except the input embedding's table
(each storage once), and prints them with bits per linear weight. Divide by a measured token
time for the bytes per second a forward streams, against the machine's read bandwidth
(`quant_rate.py` measures it).
The key/value cache is not counted (it grows with the context: `bench/memory.py`).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from specdecode.core.draft_spec import resolve_draft_vocab
from specdecode.kernels.panels import PANELS_BUFFER
from specdecode.kernels.quantize import is_quantized
from specdecode.models.loading import load_model


def read_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes per kind ("int4", "q6", "int8", "bfloat16 linears", "other") a one-token forward
    of `model` reads; the input embedding's table is left out."""
    skip = {model.get_input_embeddings().weight.untyped_storage().data_ptr()}
    seen: set[int] = set()
    kinds: dict[str, int] = defaultdict(int)
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:  # fmt: skip
            if tensor.is_meta or (name == "weight" and _computes_without_weight(module)):
                continue  # a freed weight, or one the kernel does not read (a draft keeps it)
            key = tensor.untyped_storage().data_ptr()
            if key in seen or key in skip:
                continue
            seen.add(key)
            kinds[_kind(module, name)] += tensor.untyped_storage().nbytes()
    return dict(kinds)


def _computes_without_weight(module: torch.nn.Module) -> bool:
    return is_quantized(module) or PANELS_BUFFER in module._buffers


def _kind(module: torch.nn.Module, name: str) -> str:
    if name == PANELS_BUFFER:
        return "bfloat16 linears"
    quantized = {"_specdecode_q4": "int4", "_specdecode_q6": "q6", "_specdecode_qweight": "int8"}
    for prefix, kind in quantized.items():
        if name.startswith(prefix):
            return kind
    if name == "_specdecode_scale":
        return "int8"
    if isinstance(module, torch.nn.Linear) and name == "weight":
        return "bfloat16 linears"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model specs (a preset, :int4, :int8, ...)")
    parser.add_argument(
        "--role",
        action="append",
        default=[],
        help="per model, in order: target (frees bfloat16 weights) or draft (keeps them)",
    )
    parser.add_argument(
        "--draft-vocab",
        default=None,
        metavar="N|all",
        help="a draft's output layer on the first N ids and the special ones, as decoding "
        "loads it (default: as there, $SPECDECODE_DRAFT_VOCAB or 65536)",
    )
    args = parser.parse_args()
    try:
        draft_vocab = resolve_draft_vocab(args.draft_vocab)
    except ValueError as err:
        parser.error(str(err))
    roles = args.role + ["target"] * (len(args.models) - len(args.role))
    for spec, role in zip(args.models, roles, strict=True):
        vocab = draft_vocab if role == "draft" else None
        loaded = load_model(spec, role=role, draft_vocab=vocab)
        kinds = read_bytes(loaded.model)
        linear_weights = sum(
            m.weight.numel()
            for m in loaded.model.modules()
            if isinstance(m, torch.nn.Linear) and m is not loaded.model.get_input_embeddings()
        )
        total = sum(kinds.values())
        print(f"{spec} ({role}): {total / 1e6:,.1f} MB a token")
        for kind, size in sorted(kinds.items(), key=lambda item: -item[1]):
            print(f"  {kind:17s} {size / 1e6:9,.1f} MB")
        print(f"  {8 * total / linear_weights:.3f} bits per linear weight, all counted")


if __name__ == "__main__":
    main()
