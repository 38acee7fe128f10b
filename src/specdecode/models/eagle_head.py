"""An EAGLE-style draft head: one decoder layer over the target's own features.

EAGLE (Li et al. 2024) drafts with the target's last hidden state instead of a second model: at
position j the head reads f_j, the target's feature there (the final norm's output, what its
output layer reads), and the embedding of the token after it, t_{j+1}; one decoder layer predicts
f_{j+1}, and the target's own output layer turns that into the next token t_{j+2}. Drafting
further feeds the head its own predicted feature. A step costs one layer and an output layer, not
a model: about a tenth of the target's weights for Qwen2.5-1.5B over the draft vocabulary (its
measured cost and acceptance: docs/results.md).

The layer is the target family's own decoder layer (a one-layer model built from the target's
config by Hugging Face, not code of ours), started from a copy of the target's last layer; `fc`
maps [embedding, feature] (2D) to its input (D). The output layer is the target's, over the draft
vocabulary (models/draft_vocab.py), and never trained. What is trained and saved: `fc` and the
layer (with its norm). Save/load: DIR/head.safetensors and DIR/head.json (drafters/eagle.py,
distill/eagle.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdecode.core.cache import cache_kwarg
from specdecode.kernels.quantize import is_quantized, quantized_weights
from specdecode.models.draft_vocab import DraftVocabHead, kept_ids
from specdecode.models.fetch import sha256_file
from specdecode.models.files import load_json, save_json, write_atomic


def head_config(target_config: Any) -> Any:
    """The target's config cut to one decoder layer, with no vocabulary of its own (the head
    reads embeddings and writes through the target's output layer)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[-1:])
    config.vocab_size = 1
    config.pad_token_id = None
    config.tie_word_embeddings = False
    return config


class EagleHead(torch.nn.Module):
    """fc [2D -> D] + one decoder layer and its norm (`body`, a one-layer base model); the
    output layer (`output`) is the target's over the kept ids, set by `attach_output`."""

    def __init__(self, target_config: Any) -> None:
        super().__init__()
        # slow import (transformers' model classes, ~1.5 s): eagle_head is imported by the
        # command line's parser (through the drafters)
        from transformers import AutoModel

        config = head_config(target_config)
        hidden = config.hidden_size
        self.config = config
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.body = AutoModel.from_config(config)
        self.body.embed_tokens.requires_grad_(False)  # a placeholder: the head reads embeddings
        self.output: DraftVocabHead | None = None

    @classmethod
    def from_target(cls, target: Any) -> EagleHead:
        """A head to train: the layer and the final norm copied from the target's last layer
        and norm (float32), fc as [embedding, feature] -> embedding + feature / 2."""
        head = cls(target.config)
        base = target.get_decoder()
        with torch.no_grad():
            head.body.layers[0].load_state_dict(_float_state(base.layers[-1], head.body.layers[0]))
            head.body.norm.load_state_dict(_float_state(base.norm, head.body.norm))
            hidden = head.config.hidden_size
            eye = torch.eye(hidden)
            head.fc.weight.copy_(torch.cat([eye, eye / 2], dim=1))
        return head.float()

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What training changes and a head folder keeps: fc and the body (layer and norm)."""
        return {
            name: tensor
            for name, tensor in self.state_dict().items()
            if not name.startswith(("output.", "body.embed_tokens."))
        }

    def attach_output(self, target: Any, vocab_size: int | None, tokenizer: Any = None) -> None:
        """The target's output layer over its first `vocab_size` ids and every special one
        (all of them with None), in the head's dtype; a copy: the head may be quantized."""
        weight = output_weight(target)  # [V, D]
        vocab = weight.shape[0]
        configs = [getattr(target, name, None) for name in ("config", "generation_config")]
        keep = kept_ids(vocab, vocab_size or vocab, tokenizer, configs)
        linear = torch.nn.Linear(weight.shape[1], vocab, bias=False, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        dtype = self.fc.weight.dtype
        self.output = DraftVocabHead(linear, keep).to(dtype)
        self.output.requires_grad_(False)

    def get_input_embeddings(self) -> torch.nn.Module:
        """The body's placeholder embedding (one row): the head reads the target's."""
        return self.body.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.output

    def forward(
        self,
        embeds: torch.Tensor,  # [n, D]: the embeddings of t_{j+1}
        features: torch.Tensor,  # [n, D]: f_j, the target's (or the head's own predicted)
        positions: torch.Tensor,  # [n] int64: j
        cache: Any = None,  # a transformers DynamicCache over earlier positions, or None
    ) -> torch.Tensor:
        """The predicted features f_{j+1}: [n, D] (after the head's norm, as the target's)."""
        dtype = self.fc.weight.dtype  # (a quantized fc keeps its weight's dtype, on meta)
        x = self.fc(torch.cat([embeds.to(dtype), features.to(dtype)], dim=-1))  # [n, D]
        out = self.body(
            inputs_embeds=x[None],
            position_ids=positions[None],
            use_cache=cache is not None,
            **{cache_kwarg(type(self.body)): cache},
        )
        return out.last_hidden_state[0]  # [n, D]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[n, D] -> [n, V] over the target's vocabulary (-inf outside the kept ids)."""
        if self.output is None:
            raise ValueError("attach_output(target, ...) first")
        return self.output(features)


def output_weight(target: Any) -> torch.Tensor:
    """The target's output layer weight [V, D] as a plain tensor: its own, or (a tied output
    layer whose weight a quantized target freed) the input embedding, or dequantized codes."""
    head = target.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is not None and not weight.is_meta:
        return weight.detach()
    embed = target.get_input_embeddings().weight
    if getattr(target.config, "tie_word_embeddings", False) and not embed.is_meta:
        return embed.detach()

    return quantized_weights(head)


def _float_state(source: torch.nn.Module, like: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`source`'s parameters under `like`'s state-dict names, float32: a quantized target's
    linears (their bfloat16 weights freed) give their dequantized weights."""
    modules = dict(source.named_modules())
    state = {}
    for name in like.state_dict():
        owner, _, attr = name.rpartition(".")
        module = modules[owner]
        tensor = getattr(module, attr)
        if attr == "weight" and (tensor.is_meta or is_quantized(module)):
            tensor = quantized_weights(module)
        state[name] = tensor.detach().float().clone()
    return state


# -- a head's folder: DIR/head.safetensors, then DIR/eagle.json (written last) --------------

HEAD_FILE, HEAD_RECORD, HEAD_FORMAT = "head.safetensors", "eagle.json", 1
# the target config fields a head's shapes depend on
TARGET_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)


def target_fingerprint(target: Any) -> dict[str, Any]:
    return {name: getattr(target.config, name, None) for name in TARGET_FIELDS}


def write_head(out: Path, head: EagleHead, record: dict[str, Any]) -> None:
    """The trained weights, then the record naming their hash: only a whole folder loads."""
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / HEAD_RECORD
    if record_path.exists():
        record_path.unlink()  # no head that loads until the last write
    state = {name: t.detach().cpu().contiguous() for name, t in head.trained_state().items()}
    write_atomic(out / HEAD_FILE, "the head", lambda path: save_file(state, str(path)))
    record = {**record, "format": HEAD_FORMAT, "sha256": sha256_file(out / HEAD_FILE)}
    save_json(record_path, record, HEAD_RECORD)


def read_head_record(folder: str | Path) -> dict[str, Any]:
    """DIR/eagle.json, checked against DIR/head.safetensors; ValueError naming what is wrong."""
    out = Path(folder).expanduser()
    if not out.is_dir():
        raise ValueError(f"EAGLE head {folder}: no such folder")
    record_path, weights = out / HEAD_RECORD, out / HEAD_FILE
    if not record_path.is_file():
        raise ValueError(
            f"EAGLE head {folder}: no {HEAD_RECORD} (an unfinished or missing training: run "
            "`specdecode distill --kind eagle --out DIR` to finish or write one)"
        )
    try:
        record = load_json(record_path)
    except ValueError as err:
        raise ValueError(f"EAGLE head {folder}: {HEAD_RECORD} is not JSON ({err})") from None
    if not isinstance(record, dict) or record.get("format") != HEAD_FORMAT:
        raise ValueError(f"EAGLE head {folder}: {HEAD_RECORD} is not a head record")
    if not weights.is_file() or sha256_file(weights) != record.get("sha256"):
        raise ValueError(
            f"EAGLE head {folder}: {HEAD_FILE} is missing or not the one {HEAD_RECORD} records "
            "(changed or half-written): train it again"
        )
    return record


def load_head(folder: str | Path, target: Any, vocab_size: int | None, tokenizer: Any = None):
    """The head in DIR for `target` (a model), in the target's dtype and device, with the
    target's output layer over `vocab_size` ids attached; ValueError if DIR's head was trained
    for a target of other shapes."""
    record = read_head_record(folder)
    have = target_fingerprint(target)
    differ = [k for k in TARGET_FIELDS if record["target_config"].get(k) != have.get(k)]
    if differ:
        raise ValueError(
            f"EAGLE head {folder} was trained for {record['target']} ("
            + ", ".join(f"{k}={record['target_config'].get(k)}" for k in differ)
            + "), not for this target ("
            + ", ".join(f"{k}={have.get(k)}" for k in differ)
            + ")"
        )
    head = EagleHead(target.config)
    missing, unexpected = head.load_state_dict(
        load_file(str(Path(folder).expanduser() / HEAD_FILE)), strict=False
    )
    if unexpected or any(not n.startswith("body.embed_tokens.") for n in missing):
        raise ValueError(f"EAGLE head {folder}: {HEAD_FILE} does not hold this head's weights")
    parameter = next(target.parameters())
    head = head.to(parameter.device, parameter.dtype).eval()
    head.requires_grad_(False)
    head.attach_output(target, vocab_size, tokenizer)
    return head, record
