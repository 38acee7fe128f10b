"""EAGLE-3 head folders written as the published ones are, with random weights: the config
fields and weight names of a `speculators` checkpoint (Llama-3.1-8B's head, scaled down) and of
an EAGLE-repository / SpecForge one (a Qwen target's head, scaled down). Shapes follow the
published configs; sizes are a tiny target's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _layer_config(target, **extra) -> dict:
    config = target.config
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": 2 * config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.hidden_size // config.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "vocab_size": config.vocab_size,
        "num_hidden_layers": 1,
        **extra,
    }


def _weights(target, layer: dict, draft_ids: torch.Tensor, prefix: str, seed: int, **opts):
    """Random weights under `prefix` (`layers.0.` or `midlayer.`) for a head over `target`;
    its lm_head rows the target's (scaled) so that it drafts something the target likes."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = layer["hidden_size"], layer["intermediate_size"]
    heads, kv, d = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=gen) * scale

    w = {
        "fc.weight": rand(hidden, 3 * target.config.hidden_size),
        f"{prefix}input_layernorm.weight": torch.ones(hidden),
        f"{prefix}hidden_norm.weight": torch.ones(hidden),
        f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
        f"{prefix}self_attn.q_proj.weight": rand(heads * d, 2 * hidden),
        f"{prefix}self_attn.k_proj.weight": rand(kv * d, 2 * hidden),
        f"{prefix}self_attn.v_proj.weight": rand(kv * d, 2 * hidden),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, heads * d),
        f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": target.lm_head.weight.detach()[draft_ids].clone() * 3,
        "d2t": draft_ids - torch.arange(draft_ids.numel()),
        "t2d": torch.zeros(layer["vocab_size"], dtype=torch.bool).index_fill(0, draft_ids, True),
    }
    if opts.get("fc_bias"):
        w["fc.bias"] = rand(hidden)
    if opts.get("embed"):
        w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    return w


def speculators_head(folder: Path, target, draft_vocab: int, seed: int = 0, **extra) -> Path:
    """A head as `speculators` writes one for Llama-3.1-8B (RedHatAI/...-speculator.eagle3):
    config with speculators_model_type "eagle3" and transformer_layer_config (llama3 rope),
    weights `layers.0.*`, its own embed_tokens, fc with a bias, safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    layer = _layer_config(target, rope_theta=500000.0, rope_scaling=rope, **extra)
    layers = target.config.num_hidden_layers
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [1, layers // 2, layers - 1],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                         "architectures": ["LlamaForCausalLM"]},
        },
    }  # fmt: skip
    ids = torch.arange(draft_vocab) * (layer["vocab_size"] // draft_vocab)  # every few ids
    (folder / "config.json").write_text(json.dumps(config))
    weights = _weights(target, layer, ids, "layers.0.", seed, fc_bias=True, embed=True)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def eagle_repo_head(folder: Path, target, draft_vocab: int, seed: int = 1, **extra) -> Path:
    """A head as the EAGLE repository and SpecForge write one (a Qwen target's, e.g.
    Tengyunw/qwen3_8b_eagle3): a flat Llama config with architectures LlamaForCausalLMEagle3,
    draft_vocab_size and no layer ids (the default three), weights `midlayer.*`, no
    embed_tokens (the target's is read), fc without a bias, norm before the residual,
    pytorch_model.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    layer = _layer_config(target, rope_theta=1000000.0, **extra)
    config = {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": True,
        "torch_dtype": "bfloat16",
    }
    ids = torch.arange(draft_vocab)  # the first ids
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(_weights(target, layer, ids, "midlayer.", seed), folder / "pytorch_model.bin")
    return folder
