"""An EAGLE-3 draft head, in the layout the published heads use.

EAGLE-3 (Li et al. 2025, arXiv:2503.01840) drafts with one decoder layer over three of the
target's hidden states instead of a second model. At head position j it reads the residual
stream entering three of the target's layers at j (low, middle, high: by default 2, L // 2 and
L - 3 of L layers; hidden-state indices as in cache.FeatureTaps), fused by `fc` [3T -> H], and
the embedding of the token after it, t_{j+1}; the layer's attention reads both side by side
([input_layernorm(embedding), hidden_norm(fused)], 2H wide). Its output h (before the final
norm) is the head's guess at the next position's state; through `norm` and `lm_head` over the
draft vocabulary it is the distribution of t_{j+2}, draft id d being target id d + d2t[d].
Drafting further feeds h in place of fc's output.

The published layouts (`eagle3:DIR` reads either; docs/usage.md): a folder with config.json and
model.safetensors (or pytorch_model.bin) whose weights are named as `speculators` writes them
(`layers.0.*`; config with `speculators_model_type` "eagle3", `transformer_layer_config`,
`draft_vocab_size`) or as the EAGLE repository and SpecForge do (`midlayer.*`; a Llama config
with `draft_vocab_size`), `d2t` the offsets from draft to target ids. A head without its own
`embed_tokens` reads the target's. `specdecode distill --kind eagle` writes the speculators
layout, with DIR/eagle.json (written last) recording its training and the weights' hash.

The layer's parts are Hugging Face's Llama modules (rotary embedding, RMSNorm, MLP); only the
attention, whose projections read 2H, is written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdecode.models.fetch import sha256_file
from specdecode.models.files import load_json, save_json, write_atomic

CONFIG_FILE, WEIGHTS_FILE, RECORD_FILE, RECORD_FORMAT = (
    "config.json",
    "model.safetensors",
    "eagle.json",
    2,
)
OTHER_WEIGHTS = "pytorch_model.bin"  # the EAGLE repository's heads


@dataclass(frozen=True)
class HeadShape:
    """What a head folder's config.json says about the head and the target it was made for."""

    layer: dict[str, Any]  # the decoder layer's Llama config (hidden_size, heads, rope, ...)
    draft_vocab: int
    target_vocab: int
    target_hidden: int
    aux_layers: tuple[int, ...] | None  # the target's hidden-state indices; None: the default
    norm_before_residual: bool
    verifier: str | None  # the target it was trained for, where the config names it

    @property
    def hidden(self) -> int:
        return int(self.layer["hidden_size"])

    def aux_for(self, target_layers: int) -> tuple[int, ...]:
        """The hidden-state indices the head reads on a target of `target_layers` layers."""
        if self.aux_layers is not None:
            return self.aux_layers
        return (2, target_layers // 2, target_layers - 3)


def read_shape(raw: dict[str, Any], where: str) -> HeadShape:
    """A HeadShape from a config.json's dict (speculators' or the EAGLE repository's); a
    ValueError naming `where` for anything else."""
    if raw.get("speculators_model_type") == "eagle3":
        layer = dict(raw.get("transformer_layer_config") or {})
        verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
        name = verifier.get("name_or_path")
    elif "draft_vocab_size" in raw and "hidden_size" in raw:
        layer, name = dict(raw), None
    else:
        raise ValueError(
            f"{where} is not an EAGLE-3 head's config (no speculators_model_type 'eagle3', "
            "no draft_vocab_size)"
        )
    missing = [
        key
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        if key not in layer
    ]
    if missing or "draft_vocab_size" not in raw:
        raise ValueError(f"{where}: an EAGLE-3 config without {missing or ['draft_vocab_size']}")
    if int(layer.get("num_hidden_layers") or 1) != 1:
        raise ValueError(
            f"{where}: a head of {layer['num_hidden_layers']} decoder layers (EAGLE-3 heads of "
            "one layer load here)"
        )
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return HeadShape(
        layer=layer,
        draft_vocab=int(raw["draft_vocab_size"]),
        target_vocab=int(layer["vocab_size"]),
        target_hidden=int(raw.get("target_hidden_size") or layer["hidden_size"]),
        aux_layers=tuple(int(i) for i in aux) if aux else None,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        verifier=name,
    )


def _layer_config(shape: HeadShape) -> Any:
    # slow import (transformers' model classes, ~1.5 s): eagle_head is imported by the
    # command line's parser (through the drafters)
    from transformers import LlamaConfig

    fields = {k: v for k, v in shape.layer.items() if k not in ("architectures", "model_type")}
    fields["num_hidden_layers"] = 1
    return LlamaConfig(**fields)


class Eagle3Attention(torch.nn.Module):
    """Self-attention whose projections read [embedding, hidden] (2H) and write H."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // self.heads)
        self.q_proj = torch.nn.Linear(2 * hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, hidden, bias=bias)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, 2H] -> queries [Hq, n, d], keys and values [Hkv, n, d], rotated."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        n, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(n, self.heads, d).transpose(0, 1)
        k = self.k_proj(x).view(n, self.kv_heads, d).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, d).transpose(0, 1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)  # cos, sin [n, d]
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,  # [Hq, n, d]
        k: torch.Tensor,  # [Hkv, L, d]
        v: torch.Tensor,  # [Hkv, L, d]
        allowed: torch.Tensor,  # [n, L] bool: which keys each query sees
    ) -> torch.Tensor:
        """-> [n, H]: the attention's output projected back."""
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, L, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # [Hq, n, d]
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))


class Eagle3Layer(torch.nn.Module):
    """The head's decoder layer: named as the published weights name it."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)


class Eagle3Head(torch.nn.Module):
    """fc [3T -> H], one Eagle3Layer, the final norm, lm_head [H -> draft vocabulary] and d2t;
    `embed_tokens` where the head has its own (else the target's is handed to `embed`)."""

    def __init__(self, shape: HeadShape, aux_layers: tuple[int, ...], own_embedding: bool):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        config = _layer_config(shape)
        self.shape, self.config, self.aux_layers = shape, config, aux_layers
        hidden = config.hidden_size
        self.embed_tokens = (
            torch.nn.Embedding(shape.target_vocab, hidden) if own_embedding else None
        )
        self.fc = torch.nn.Linear(len(aux_layers) * shape.target_hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList([Eagle3Layer(config)])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, shape.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab, dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(config)

    @property
    def dtype(self) -> torch.dtype:
        """The head's activations' dtype (a norm's: a quantized linear's weight is on meta)."""
        return self.norm.weight.dtype

    def get_input_embeddings(self) -> torch.nn.Module | None:
        """Its own embedding (a lookup), or None where it reads the target's."""
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def target_ids(self) -> torch.Tensor:
        """[draft vocabulary] int64: each draft id's target id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, d] of positions [n]."""
        cos, sin = self.rotary(self.norm.weight[None, None], positions[None])
        return cos[0].to(self.dtype), sin[0].to(self.dtype)

    def step_in(
        self, embeds: torch.Tensor, hidden: torch.Tensor, from_target: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's input [n, 2H] and the residual [n, H], from the embeddings [n, H] and
        the target's features [n, 3T] (`from_target`) or the head's own outputs [n, H]."""
        layer = self.layers[0]
        hidden = hidden.to(self.dtype)
        if from_target:
            hidden = self.fc(hidden)
        if self.shape.norm_before_residual:
            hidden = residual = layer.hidden_norm(hidden)
        else:
            residual, hidden = hidden, layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds.to(self.dtype)), hidden], dim=-1)
        return x, residual

    def step_out(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output h [n, H] (before the final norm) after its attention."""
        layer = self.layers[0]
        h = residual + attended
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(
        self,
        embeds: torch.Tensor,  # [n, H]: the embeddings of t_{j+1}
        hidden: torch.Tensor,  # [n, 3T] the target's features at j, or [n, H] the head's own
        positions: torch.Tensor,  # [n] int64: j (consecutive after the cache's, unless a tree)
        cache: Any,  # a transformers DynamicCache over the head's earlier positions
        from_target: bool,
        allowed: torch.Tensor | None = None,  # [n, past + n] bool (a tree's); None: causal
    ) -> torch.Tensor:
        """h [n, H]: the layer's output (its final norm and lm_head give the next token)."""
        x, residual = self.step_in(embeds, hidden, from_target)
        attn = self.layers[0].self_attn
        q, k, v = attn.project(x, *self.rope(positions))
        past = cache.get_seq_length()
        k, v = cache.update(k[None], v[None], 0)  # [1, Hkv, past + n, d]
        if allowed is None:
            n, length = x.shape[0], k.shape[2]
            allowed = (
                torch.arange(length, device=x.device)[None]
                <= past + torch.arange(n, device=x.device)[:, None]
            )  # [n, L]: causal
        return self.step_out(residual, attn.attend(q, k[0], v[0], allowed))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, draft vocabulary], float32."""
        return self.lm_head(self.norm(h)).float()


# -- a head's folder ------------------------------------------------------------------------


def _weights_path(folder: Path) -> Path:
    for name in (WEIGHTS_FILE, OTHER_WEIGHTS):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"EAGLE-3 head {folder}: no {WEIGHTS_FILE} (nor {OTHER_WEIGHTS})")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights under the speculators names (`midlayer.` read as `layers.0.`)."""
    if path.suffix == ".safetensors":
        raw = load_file(str(path))
    else:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    out = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        out[name] = tensor
    return out


def read_record(folder: Path) -> dict[str, Any] | None:
    """DIR/eagle.json of a head trained here, checked against DIR's weights (None for a head
    from elsewhere); ValueError for a record that does not match."""
    record_path = folder / RECORD_FILE
    if not record_path.is_file():
        return None
    try:
        record = load_json(record_path)
    except ValueError as err:
        raise ValueError(f"EAGLE-3 head {folder}: {RECORD_FILE} is not JSON ({err})") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ValueError(
            f"EAGLE-3 head {folder}: {RECORD_FILE} is not an EAGLE-3 head's record (a head "
            "of an older kind: train it again with `specdecode distill --kind eagle`)"
        )
    weights = folder / WEIGHTS_FILE
    if not weights.is_file() or sha256_file(weights) != record.get("sha256"):
        raise ValueError(
            f"EAGLE-3 head {folder}: {WEIGHTS_FILE} is missing or not the one {RECORD_FILE} "
            "records (changed or half-written): train it again"
        )
    return record


def head_mismatch(shape: HeadShape, target: Any) -> str | None:
    """Why a head of `shape` cannot read `target`'s features (one clause), or None."""
    config = getattr(target.config, "text_config", target.config)
    layers = int(config.num_hidden_layers)
    vocab = int(target.get_input_embeddings().weight.shape[0])
    made_for = f" (for {shape.verifier})" if shape.verifier else ""
    if shape.target_hidden != config.hidden_size:
        return (
            f"it reads hidden size {shape.target_hidden}{made_for}, this target's is "
            f"{config.hidden_size}"
        )
    if shape.target_vocab != vocab:
        return (
            f"it writes a vocabulary of {shape.target_vocab} tokens{made_for}, this target's "
            f"has {vocab}"
        )
    aux = shape.aux_for(layers)
    if len(aux) != 3 or any(not 0 <= i < layers for i in aux):
        return (
            f"it reads hidden states {list(aux)}{made_for}, this target has {layers} layers "
            f"(0 to {layers - 1})"
        )
    return None


def load_head(folder: str | Path, target: Any) -> tuple[Eagle3Head, dict[str, Any] | None]:
    """The EAGLE-3 head in DIR for `target` (a model), in the target's dtype and device, and
    its training record where it was trained here (else None); ValueError naming the mismatch
    for a head made for another target, or a folder that holds no head."""
    out = Path(folder).expanduser()
    if not out.is_dir():
        raise ValueError(f"EAGLE-3 head {folder}: no such folder")
    record = read_record(out)
    if not (out / CONFIG_FILE).is_file():
        raise ValueError(f"EAGLE-3 head {folder}: no {CONFIG_FILE}")
    try:
        raw = load_json(out / CONFIG_FILE)
    except ValueError as err:
        raise ValueError(f"EAGLE-3 head {folder}: {CONFIG_FILE} is not JSON ({err})") from None
    shape = read_shape(raw if isinstance(raw, dict) else {}, f"EAGLE-3 head {folder}")
    problem = head_mismatch(shape, target)
    if problem:
        raise ValueError(f"EAGLE-3 head {folder} is for another target: {problem}")
    weights = _read_weights(_weights_path(out))
    own_embedding = "embed_tokens.weight" in weights
    if not own_embedding and shape.hidden != shape.target_hidden:
        raise ValueError(
            f"EAGLE-3 head {folder}: no embed_tokens of its own, and its hidden size "
            f"{shape.hidden} is not the target's {shape.target_hidden}"
        )
    config = getattr(target.config, "text_config", target.config)
    head = Eagle3Head(shape, shape.aux_for(int(config.num_hidden_layers)), own_embedding)
    if "fc.bias" in weights:  # the speculators trainer's fc has a bias
        head.fc.bias = torch.nn.Parameter(torch.zeros(head.fc.out_features))
    state = {k: v for k, v in weights.items() if k != "t2d"}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"EAGLE-3 head {folder}: its weights are not an EAGLE-3 head's (missing "
            f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})"
        )
    ids = head.target_ids()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= shape.target_vocab):
        raise ValueError(
            f"EAGLE-3 head {folder}: d2t maps draft ids outside the target's vocabulary"
        )
    parameter = next(target.parameters())
    head = head.to(parameter.device, parameter.dtype).eval()
    head.requires_grad_(False)
    return head, record


def head_config(head: Eagle3Head, verifier: str) -> dict[str, Any]:
    """The config.json of `head` in the speculators layout."""
    layer = head.config.to_diff_dict()
    layer.update(model_type="llama", num_hidden_layers=1, vocab_size=head.shape.target_vocab)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": head.shape.draft_vocab,
        "norm_before_residual": head.shape.norm_before_residual,
        "target_hidden_size": head.shape.target_hidden,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier},
        },
    }


def write_head(
    out: Path,
    head: Eagle3Head,
    verifier: str,
    record: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """config.json, model.safetensors (speculators' names, t2d included, the weights in
    `dtype`: the target's, as published heads are), then eagle.json naming the weights' hash:
    only a whole folder loads as a head trained here."""
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / RECORD_FILE
    if record_path.exists():
        record_path.unlink()  # no head that loads until the last write
    state = {
        name: t.detach().cpu().to(dtype if t.is_floating_point() else t.dtype).contiguous()
        for name, t in head.state_dict().items()
        if not name.startswith(("embed_tokens.", "rotary."))
    }
    t2d = torch.zeros(head.shape.target_vocab, dtype=torch.bool)
    t2d[head.target_ids().cpu()] = True
    state["t2d"] = t2d
    save_json(out / CONFIG_FILE, head_config(head, verifier), CONFIG_FILE)
    write_atomic(out / WEIGHTS_FILE, "the head", lambda path: save_file(state, str(path)))
    record = {**record, "format": RECORD_FORMAT, "sha256": sha256_file(out / WEIGHTS_FILE)}
    save_json(record_path, record, RECORD_FILE)
