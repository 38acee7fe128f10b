"""A lean forward for Llama-family models: the model's layers, weights and linear kernels, run
as a few large operations per layer over a cache of its own. Drafts run it, and so does the
target where it can (`target_cache`).

Why: through Hugging Face's code, a one-token forward of the int8 0.5B draft spent about as long
outside its linear layers (on the CPU kernels) as in them, in a thousand-odd small operations per
forward: dtype casts, mask building, a cache that grows by concatenation (every step copies it),
rotary embedding in seven operations per tensor. Here each layer is the model's own linear
weights around four fused C++ calls (`kernels/draft_ops.cpp`: residual add + RMSNorm twice;
rotary embedding, the cache write and attention once; SiLU times the up projection once), with
keys/values written in place into a preallocated float32 cache (both forwards timed side by side:
docs/results.md). The linears are the kernel calls themselves
(`direct_linear`): called through their modules, the Python around the 169 kernel calls of the
0.5B int4 draft was a large share of its one-token forward
(docs/results.md). Where every projection is such a call,
the whole layer loop runs in one C++ call (`kernels/lean_layers.cpp`: the same calls in the same
order, so the same bits, without the interpreter between them; `NATIVE_LOOP`). A target's
forward is the same shape of work, paid once per step, and on 4-bit weights the same overhead
is a larger share of it.
Where the model's linears are not on the CPU kernels (other dtypes, no AVX2, `--kernel off`) and
above `fused_tokens` tokens (prefill) the same maths runs in PyTorch operations.

Same arithmetic as the model's own forward up to rounding (norms round as its bfloat16 norms do;
rotary embedding, the cache and attention are float32). A quantized target (`:int4`, `:int8`)
keeps its hidden states, the residual stream between layers, in float32 instead, as llama.cpp
does (`target_residual`): there the reference is the quantized model itself, and bfloat16 hidden
states were a large share of its distance to float32 arithmetic (docs/results.md); the
linears still read bfloat16 inputs. Only for the families whose layers it
knows (Llama, Qwen2, Mistral without a sliding window: pre-norm, rotary, grouped-query attention,
SwiGLU); any other model keeps Hugging Face's forward.

A target on it stays lossless because every forward that can produce a token (a step's, over at
most `VERIFY_TOKENS` rows) takes the fused path, whose rows are batch invariant: each row's
linears (the kernels' fixed reduction order), norms and attention (its own scores, softmax and
sum, in the same order whatever the other rows; masked keys add exact zeros) come out bit for bit
as in a one-token forward, so verifying n drafted tokens gives each the logits the target alone
would have given it (docs/architecture.md, Invariants 1; tests/test_lean_target.py). Only the
prompt's prefill, which both share, may take the PyTorch path.

SPECDECODE_DRAFT_FORWARD=hf keeps Hugging Face's forward for every draft,
SPECDECODE_TARGET_FORWARD=hf for every target.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.core.cache import Cache, KVCache, compaction, feature_width, tapped_features
from specdecode.core.store import RowPool, StoreFull, kv_shape, tensor_bytes
from specdecode.kernels.build import KernelUnavailable, extension
from specdecode.kernels.cpu_linear import direct_linear, prefill_linear
from specdecode.kernels.panels import on_kernel
from specdecode.kernels.quantize import is_quantized
from specdecode.models.draft_vocab import DraftVocabHead
from specdecode.models.prefix_cache import PrefixCache, common_prefix

FAMILIES = ("llama", "qwen2", "mistral")
OUTPUT_LAYERS = (torch.nn.Linear, DraftVocabHead)  # a draft's may keep part of the vocabulary
ENV = "SPECDECODE_DRAFT_FORWARD"  # "hf": Hugging Face's forward for every draft; else "lean"
TARGET_ENV = "SPECDECODE_TARGET_FORWARD"  # the same for every target
PREFILL_CHUNK = 512  # longer inputs run in chunks: attention scores stay [H, 512, L]
CAPACITY = 256  # positions a LeanCache starts with
FUSED_TOKENS = 16  # the fused C++ operations serve up to this many tokens (drafting, not prefill)
# a target's fused path covers every verification (a chain's k + 1, a tree's nodes + 1 rows):
# longer forwards are prefill only
VERIFY_TOKENS = 128
# the fused path's layer loop runs in C++ (kernels/lean_layers.cpp) where it can; False keeps it
# in Python (the same calls: for comparisons, and for tools that wrap the calls one by one)
NATIVE_LOOP = True
# scaled_dot_product_attention's enable_gqa (torch >= 2.5): key/value heads shared without copies
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot run the lean forward, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} (the lean forward knows SwiGLU)"
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    if windowed or any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "sliding-window attention"
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, name) for name in needed):
        return "not a decoder with embed_tokens / layers / norm / rotary_emb"
    if not isinstance(getattr(model, "lm_head", None), OUTPUT_LAYERS) or model.training:
        return "no linear output layer, or the model is in training mode"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (
            attn is None
            or mlp is None
            or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
            or hasattr(attn, "q_norm")  # per-head norms (Qwen3-style) are not modelled here
            or not hasattr(layer, "input_layernorm")
            or not hasattr(layer, "post_attention_layernorm")
        ):
            return f"layer {type(layer).__name__} is not a Llama-style decoder layer"
    return None


def runs_lean(model: Any, env: str = ENV) -> bool:
    """Whether `model` runs through the lean forward: it knows the model and the switch `env`
    (ENV for drafts, TARGET_ENV for targets) is not "hf"."""
    choice = os.environ.get(env, "lean").lower() or "lean"
    if choice not in ("lean", "hf"):
        raise ValueError(f"{env} must be lean or hf (got {choice!r})")
    return choice == "lean" and unsupported_reason(model) is None


def draft_cache(model: Any, fused_tokens: int = FUSED_TOKENS) -> KVCache | LeanCache:
    """The cache a drafter runs `model` through: a LeanCache where the lean forward supports the
    model (and SPECDECODE_DRAFT_FORWARD is not "hf"), else the KVCache over its own forward.
    `fused_tokens`: the longest forward on the fused path (`LeanCache`); a draft prefilled in
    parts of up to VERIFY_TOKENS, as a server's are, keeps its prompt fused with it at their
    size, so its prefix can be kept past PREFILL_CHUNK (`PrefixPool.take(tokens, parts)`)."""
    return LeanCache(model, fused_tokens=fused_tokens) if runs_lean(model) else KVCache(model)


def target_cache(model: Any) -> KVCache | LeanCache:
    """The cache the target runs through: a LeanCache where the lean forward supports the model,
    its fused operations run (bfloat16 linears on the CPU kernels: the path whose rows are batch
    invariant) and SPECDECODE_TARGET_FORWARD is not "hf"; else the KVCache over the model's own
    forward."""
    if runs_lean(model, TARGET_ENV):
        param = next(model.parameters())
        head_dim = model.model.layers[0].self_attn.head_dim
        if _fused_ops(model, param.dtype, param.device, head_dim) is not None:
            return LeanCache(model, fused_tokens=VERIFY_TOKENS, residual=target_residual(model))
    return KVCache(model)


def target_residual(model: Any) -> torch.dtype | None:
    """The dtype of a target's residual stream on the lean forward: float32 where its linears
    are quantized (llama.cpp keeps its hidden states in float32: bfloat16 ones were most of the
    distance between our 4-bit target and its float32 arithmetic, docs/results.md), else
    None, the model's own dtype (a bfloat16 target rounds as Hugging Face's forward does)."""
    return torch.float32 if any(is_quantized(m) for m in model.modules()) else None


def position_bytes(model: Any) -> int:
    """Bytes a LeanCache of `model` spends on one position: its keys and values in float32."""
    layers, kv_heads, head_dim = kv_shape(model)
    return layers * 2 * kv_heads * head_dim * 4


def capacity_for(n_tokens: int) -> int:
    """The positions a LeanCache holds once it has seen n_tokens: CAPACITY doubled until they
    fit (whatever the order of the forwards, so the memory estimate knows it)."""
    capacity = CAPACITY
    while n_tokens > capacity:
        capacity *= 2
    return capacity


class LeanCache(Cache):
    """KVCache's protocol (len, rollback, compact, forward) over the lean forward.

    Keys and values of all layers live in one float32 tensor [layers, 2, Hkv, capacity, d]
    (after rotary embedding), grown by doubling; the first `length` positions are valid, so a
    rollback moves a number and a compaction is one gather.
    """

    def __init__(
        self,
        model: Any,
        fused_tokens: int = FUSED_TOKENS,
        *,
        kv: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        reused: int = 0,
        release: Callable[[LeanCache], None] | None = None,
        residual: torch.dtype | None = None,
        features: torch.Tensor | None = None,
    ) -> None:
        """`kv` (a LeanStore's row, [layers, 2, Hkv, max_len, d] float32) and `ids` (its
        [max_len] int64): a fixed store to write into, never grown (StoreFull past it), whose
        first `reused` positions already hold a prefix computed on the fused path;
        `release(cache)` gives the row back (`close`); `features` ([max_len, D]) its features
        where the model keeps them (cache.keep_features).
        `residual`: the hidden states' dtype between layers (default the model's; float32 for
        a quantized target, `target_residual`): the linears still take the model's dtype."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run this model: {reason}")
        self.model = model
        self.fused_tokens = fused_tokens  # forwards of up to this many tokens take the fused path
        base = model.model
        self.layers = list(base.layers)
        attn = self.layers[0].self_attn
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.length = reused
        # the first `fused_len` positions were computed on the fused path, whose keys and
        # values do not depend on how the tokens were split into forwards (`reusable_prefix`)
        self.fused_len = reused
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.residual = residual or self.dtype
        self.fixed = kv is not None
        self._release = release
        if kv is None:
            kv = torch.empty(
                len(self.layers), 2, self.kv_heads, CAPACITY, self.head_dim, device=self.device
            )
            ids = torch.zeros(CAPACITY, dtype=torch.long, device=self.device)
        self.kv = kv
        self.ids = ids  # [capacity] int64: the token id each cached position holds
        # [capacity, W]: each position's feature, where the model keeps features
        # (cache.keep_features); a store row's are the store's, kept with its prefix
        taps = tapped_features(model)
        if features is None and taps is not None:
            features = torch.empty(kv.shape[3], taps.width, dtype=self.dtype, device=self.device)
        self._features = features
        # the hidden-state indices tapped (the final norm's is the layer count), or ()
        self._taps: tuple[int, ...] = taps.layers if taps is not None else ()
        self._fused = _fused_ops(model, self.dtype, self.device, self.head_dim)
        # per layer (q, k, v, o, gate, up, down), then the output layer: the kernel calls
        # themselves where the draft's linears run on specdecode's kernels
        self._linears = [_layer_linears(layer) for layer in self.layers]
        # the same projections for a prefill of more than VERIFY_TOKENS rows where another
        # product beats the tiles on this machine (measured: `prefill_on_torch` for bfloat16
        # panels, `prefill_on_amx` for 4-bit and 6-bit ones), else None
        self._prefill = _prefill_linears(self.layers) if self._fused is not None else None
        self._lm_head = _output_layer(model.lm_head)
        # the whole layer loop in one C++ call where every projection is a kernel call
        self._native = _native_layers(self) if self._fused is not None else None
        half = self.head_dim // 2
        # rotate_half(x) = roll(x, d/2) * [-1]*d/2 + [1]*d/2: the sign goes into sin
        self._sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device)

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this cache holds (its capacity, not only its length)."""
        return tensor_bytes(self.kv, self.ids, self._features)

    def features(self) -> torch.Tensor:
        """[len, W]: the feature of every cached position (`keep_features`)."""
        if self._features is None:
            raise ValueError("this cache keeps no features: call cache.keep_features(model) first")
        return self._features[: self.length]

    def copy(self) -> LeanCache:
        """An independent cache over the same positions (a prompt prefilled once, reused); a
        store row's copy is a cache of its own, outside the store."""
        twin = copy.copy(self)
        twin.kv, twin.ids = self.kv.clone(), self.ids.clone()
        if self._features is not None:
            twin._features = self._features.clone()
        twin.fixed, twin._release = False, None
        return twin

    def close(self) -> None:
        """Give a store row back to its store (a no-op for a cache of its own)."""
        release, self._release = self._release, None
        if release is not None:
            release(self)

    def reusable_prefix(self, tokens: Sequence[int], parts: int | None = None) -> int:
        """How many leading positions a sequence starting with `tokens` may keep from this
        cache, bit for bit what its own prefill would compute: the common prefix of `tokens`
        and the cached ids, within the positions computed on the fused path, and only where
        the prefill of `tokens` would take that path too (`keeps_prefix`)."""
        if not self.keeps_prefix(len(tokens), parts):
            return 0
        return common_prefix(self.ids[: self.fused_len], tokens)

    def keeps_prefix(self, n_tokens: int, parts: int | None = None) -> bool:
        """Whether a prefill of `n_tokens` takes the fused path for every position, so that a
        prefix computed there is the bits it would compute (`reusable_prefix`): at once, at
        most PREFILL_CHUNK of them (and at most VERIFY_TOKENS where a longer prefill takes
        PyTorch's product: `_prefill`); in forwards of at most `parts` positions each (a
        server's prefill in parts), any number where `parts` is at most `fused_tokens`."""
        if self._fused is None:
            return False
        if parts is not None and parts <= self.fused_tokens:
            return True
        return n_tokens <= PREFILL_CHUNK and not self._on_torch(n_tokens)

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} positions to {length}")
        self.length = length
        self.fused_len = min(self.fused_len, length)

    @torch.inference_mode()  # a cache grown inside a forward is an inference tensor
    def compact(self, keep: list[int] | torch.Tensor) -> None:
        """Keep only the cached positions `keep` (strictly increasing), moved to 0..len(keep)-1."""
        keep, run = compaction(keep, self.length)
        tail = keep[run:]
        if tail.numel():  # the gather copies before the write, so overlapping slots are safe
            tail = tail.to(self.device)
            self.kv[:, :, :, run : keep.numel()] = self.kv[:, :, :, tail]
            self.ids[run : keep.numel()] = self.ids[tail]
            if self._features is not None:
                self._features[run : keep.numel()] = self._features[tail]
        fused_all = self.fused_len >= self.length
        self.length = keep.numel()
        self.fused_len = self.length if fused_all else min(self.fused_len, run)

    def _reserve(self, needed: int) -> None:
        capacity = self.kv.shape[3]
        if needed > capacity and self.fixed:
            raise StoreFull(
                f"a sequence of {needed} positions does not fit the store's max_len of {capacity}"
            )
        if needed > capacity:
            grown = torch.empty(
                *self.kv.shape[:3],
                capacity_for(needed),
                self.head_dim,
                device=self.device,
            )
            grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
            self.kv = grown
            ids = torch.zeros(grown.shape[3], dtype=torch.long, device=self.device)
            ids[: self.length] = self.ids[: self.length]
            self.ids = ids
            if self._features is not None:
                features = self._features.new_empty(grown.shape[3], self._features.shape[1])
                features[: self.length] = self._features[: self.length]
                self._features = features

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        last_only: bool = False,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model over new tokens appended to the cached ones; the cache grows by n.

        input_ids: [n] int64; position_ids [n] (default: the next n positions); attention_mask
        [1, 1, n, len(self) + n], additive or bool (default: causal). Returns logits [n, V] in
        the model's dtype, or [1, V] for the last position only when `last_only`.
        """
        n = input_ids.shape[0]
        if n > PREFILL_CHUNK and attention_mask is None and position_ids is None:
            parts = [
                self.forward(input_ids[start : start + PREFILL_CHUNK], last_only)
                for start in range(0, n, PREFILL_CHUNK)
            ]
            return parts[-1] if last_only else torch.cat(parts)
        return self._forward_rows([self], [input_ids], last_only, [position_ids], [attention_mask])[
            0
        ]

    @classmethod
    def forward_many(
        cls,
        caches: Sequence[LeanCache],
        inputs: Sequence[torch.Tensor],
        *,
        last_only: bool = False,
        positions: Sequence[torch.Tensor | None],
        masks: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """`forward` of several sequences over one model in one pass (cache.forward_rows): the
        rows of all of them go through each linear together (the weights are read once), each
        sequence attends over its own cache. Row for row the same arithmetic as its own forward
        (the fused path's rows are batch invariant), so each gets the logits it would alone."""
        model = caches[0].model
        if any(cache.model is not model for cache in caches):
            raise ValueError("forward_many needs caches over one model")
        return caches[0]._forward_rows(list(caches), list(inputs), last_only, positions, masks)

    @torch.inference_mode()
    def _forward_rows(
        self,
        caches: list[LeanCache],
        inputs: list[torch.Tensor],  # one [n_b] per cache
        last_only: bool,
        positions: Sequence[torch.Tensor | None],
        masks: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        sizes = [int(ids.shape[0]) for ids in inputs]
        pasts = [cache.length for cache in caches]
        for cache, past, n in zip(caches, pasts, sizes, strict=True):
            cache._reserve(past + n)
        each = [
            pos if pos is not None else torch.arange(past, past + n, device=self.device)
            for pos, past, n in zip(positions, pasts, sizes, strict=True)
        ]
        position_ids = each[0] if len(each) == 1 else torch.cat(each)  # [N]
        base = self.model.model
        ids = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
        x = base.embed_tokens(ids).to(self.residual)  # [N, D]
        cos, sin = base.rotary_emb(x[None], position_ids[None])  # [1, N, d] each
        cos, sin = cos[0].float(), sin[0].float()  # [N, d]
        row_masks = [
            cache._mask(n, past, mask)  # [n, L] float32 or None (causal)
            for cache, n, past, mask in zip(caches, sizes, pasts, masks, strict=True)
        ]
        ends = [past + n for past, n in zip(pasts, sizes, strict=True)]
        # the fused operations are row by row: the longest sequence's rows decide, not the sum.
        # A prefill chunk takes them too while its keys fit in one chunk (as fast there:
        # docs/results.md), so a prompt's keys and values are the
        # same bits however it was split, and a store row can hand a prefix on to the next
        # prompt (LeanStore)
        # A prefill of more than VERIFY_TOKENS rows (never a verification) takes PyTorch's
        # product instead where it is the faster here (`_prefill`), and so the PyTorch path.
        on_torch = self._on_torch(max(sizes))
        fused_rows = max(sizes) <= self.fused_tokens or (
            max(ends) <= PREFILL_CHUNK and not on_torch
        )
        fused = self._fused if fused_rows else None
        bounds = list(itertools.accumulate(sizes, initial=0))
        linears = self._prefill if on_torch else self._linears
        tapped: dict[int, torch.Tensor] = {}  # hidden-state index -> [N, D]
        x, delta = self._layers(
            x, caches, pasts, cos, sin, row_masks, bounds, fused, linears, tapped
        )
        for cache, past, end, tokens in zip(caches, pasts, ends, inputs, strict=True):
            cache.ids[past:end] = tokens
            cache.length = end
            leading = fused is not None and cache.fused_len >= past
            cache.fused_len = end if leading else min(cache.fused_len, past)
        if self._features is not None:  # every row's features, then the rows asked for
            _, h = self._add_norm(x, delta, base.norm, fused)  # [N, D], row by row
            tapped[len(self.layers)] = h
            rows = torch.cat([tapped[i].to(self.dtype) for i in self._taps], dim=-1)  # [N, W]
            for cache, past, end, a, b in zip(
                caches, pasts, ends, bounds, bounds[1:], strict=False
            ):
                cache._features[past:end] = rows[a:b]
            if last_only:
                h = h[[b - 1 for b in bounds[1:]]]
                bounds = list(range(len(caches) + 1))
        elif last_only and len(caches) == 1:  # the last row: a view, contiguous as it is
            x, delta = x[-1:], delta[-1:]
        elif last_only:  # each sequence's last row
            last = torch.tensor(bounds[1:], device=self.device) - 1
            x, delta = x[last].contiguous(), delta[last].contiguous()
            bounds = list(range(len(caches) + 1))
        if self._features is None:
            _, h = self._add_norm(x, delta, base.norm, fused)
        logits = self._lm_head(h)  # [N or B, V]
        if len(caches) == 1:
            return [logits]
        return [logits[a:b] for a, b in itertools.pairwise(bounds)]

    def _layers(
        self,
        x: torch.Tensor,  # [N, D]: the embedded rows of every sequence, one after the other
        caches: list[LeanCache],
        pasts: list[int],
        cos: torch.Tensor,  # [N, d] float32
        sin: torch.Tensor,  # [N, d] float32
        row_masks: list[torch.Tensor | None],
        bounds: list[int],  # sequence b's rows are bounds[b]:bounds[b + 1]
        fused: Any,
        linears: list[tuple[Callable[[torch.Tensor], torch.Tensor], ...]],  # per layer
        tapped: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x through every decoder layer, writing each layer's keys and values -> (x, delta):
        the residual stream after the last layer and that layer's MLP output, not yet added.
        `linears`: each layer's projections (`layer_projections`' order). The residual stream
        entering each tapped layer goes to `tapped` (cache.keep_features)."""
        inner = sorted({i for i in self._taps if i < len(self.layers)})
        native = fused is not None and self._native is not None and NATIVE_LOOP
        if native:  # every sequence's rows in one call, each attending over its own cache
            x, delta, states = self._native.forward(
                x, [c.kv for c in caches], pasts, cos, sin, row_masks, bounds, inner
            )
            tapped.update(zip(inner, states, strict=True))
            return x, delta
        attend = self._attend_fused if fused is not None else self._attend
        delta = None  # the last block's output, added to x by the next norm
        for index, layer in enumerate(self.layers):
            q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj = linears[index]
            x, h = self._add_norm(x, delta, layer.input_layernorm, fused)
            if index in inner:
                tapped[index] = x
            q, k, v = q_proj(h), k_proj(h), v_proj(h)  # [N, H * d], [N, Hkv * d] x 2
            if len(caches) == 1:
                out = attend(q, k, v, cos, sin, self.kv[index], pasts[0], row_masks[0])
            else:  # each sequence over its own cache (row slices of contiguous [N, .] stay so)
                out = torch.cat(
                    [
                        attend(q[a:b], k[a:b], v[a:b], cos[a:b], sin[a:b], c.kv[index], past, m)
                        for c, a, b, past, m in zip(
                            caches, bounds[:-1], bounds[1:], pasts, row_masks, strict=True
                        )
                    ]
                )  # [N, H * d]
            x, h = self._add_norm(x, o_proj(out), layer.post_attention_layernorm, fused)  # [N, D]
            delta = down_proj(self._silu_mul(gate_proj(h), up_proj(h), fused))
        return x, delta

    def _on_torch(self, rows: int) -> bool:
        """Whether a forward of `rows` tokens runs its projections on PyTorch's product."""
        return self._prefill is not None and rows > VERIFY_TOKENS

    @staticmethod
    def _silu_mul(gate: torch.Tensor, up: torch.Tensor, fused: Any) -> torch.Tensor:
        """silu(gate) * up for gate, up [n, I], rounded as Hugging Face's MLP rounds it."""
        if fused is not None:
            return fused.silu_mul(gate, up)
        return F.silu(gate) * up

    def _mask(self, n: int, past: int, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The additive float32 mask of the n queries over L = past + n keys: [n, L]; None for
        causal attention."""
        if attention_mask is None:
            return None
        mask = attention_mask.reshape(n, -1)[:, : past + n]  # [n, L]
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, device=self.device).masked_fill(~mask, -torch.inf)
        return mask.float().contiguous()

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module, fused: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm of it in the linears' dtype) for x, delta [n, D]: rounded as
        Hugging Face's norm does when x is in the model's dtype; over a float32 residual stream
        (x float32, delta the linears' output) the sum stays float32 and the norm is rounded
        once, at the end."""
        eps = _norm_eps(norm)
        wide = x.dtype != self.dtype
        if fused is not None:
            delta = delta if delta is None else delta.contiguous()
            add_norm = fused.add_rms_norm_f32 if wide else fused.add_rms_norm
            return add_norm(x, delta, norm.weight, eps)
        if delta is not None:
            x = x + delta
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if wide:
            return x, (norm.weight.float() * h).to(self.dtype)
        return x, norm.weight * h.to(x.dtype)

    def _attend_fused(self, q, k, v, cos, sin, kv, past, mask) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no-ops after our kernels
        return self._fused.rope_attention(q, k, v, cos, sin, kv[0], kv[1], past, mask, self.scale)

    def _attend(
        self,
        q: torch.Tensor,  # [n, H * d]
        k: torch.Tensor,  # [n, Hkv * d]
        v: torch.Tensor,  # [n, Hkv * d]
        cos: torch.Tensor,  # [n, d] float32
        sin: torch.Tensor,  # [n, d] float32
        kv: torch.Tensor,  # [2, Hkv, capacity, d] float32: this layer's cache
        past: int,
        mask: torch.Tensor | None,  # [n, L] additive; None: causal
    ) -> torch.Tensor:
        """Rotary embedding, the cache write and attention in PyTorch operations -> [n, H * d]."""
        n, d, kv_heads = q.shape[0], self.head_dim, self.kv_heads
        group, kv_len = self.heads // kv_heads, past + n
        cos, sin = cos[:, None], sin[:, None] * self._sign  # [n, 1, d]
        k = k.float().view(n, kv_heads, d)
        kv[0, :, past:kv_len] = torch.addcmul(k * cos, k.roll(d // 2, -1), sin).transpose(0, 1)
        kv[1, :, past:kv_len] = v.view(n, kv_heads, d).transpose(0, 1)
        q = q.float().view(n, self.heads, d)
        q = torch.addcmul(q * cos, q.roll(d // 2, -1), sin)
        if mask is None and n > VERIFY_TOKENS:  # a prefill (never a verification)
            return self._attend_prefill(q, kv, past)
        q = q * self.scale
        # the queries of one key/value head side by side: rows (head in group, token)
        q = q.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * n, d)
        if mask is None and n > 1:  # causal over the last n positions
            rows = torch.arange(past, kv_len, device=self.device)[:, None]  # [n, 1]
            future = torch.arange(kv_len, device=self.device)[None, :] > rows  # [n, L]
            mask = torch.zeros(n, kv_len, device=self.device).masked_fill(future, -torch.inf)
        k_t = kv[0, :, :kv_len].transpose(1, 2)  # [Hkv, d, L]
        # a mask has one row per token: repeated for each query head of the group
        scores = torch.bmm(q, k_t) if mask is None else torch.baddbmm(mask.repeat(group, 1), q, k_t)
        out = torch.bmm(scores.softmax(-1), kv[1, :, :kv_len])  # [Hkv, group * n, d]
        out = out.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, self.heads * d)
        return out.to(self.dtype)

    def _attend_prefill(
        self,
        q: torch.Tensor,  # [n, H, d] float32, rotated
        kv: torch.Tensor,  # [2, Hkv, capacity, d] float32, this layer's cache written to past + n
        past: int,
    ) -> torch.Tensor:
        """Causal attention of a prefill's n queries over the first past + n cached positions
        -> [n, H * d]: PyTorch's fused attention, which skips the masked future and never holds
        the [H, n, L] scores (faster than the matmuls `_attend` runs: docs/results.md)."""
        n, kv_len = q.shape[0], past + q.shape[0]
        keys, values = kv[0:1, :, :kv_len], kv[1:2, :, :kv_len]  # [1, Hkv, L, d]
        if not _SDPA_GQA:  # before torch 2.5: each key/value head once per query head
            group = self.heads // self.kv_heads
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        causal = {"is_causal": True}  # aligned top-left: right only while nothing is cached
        if past:
            rows = torch.arange(past, kv_len, device=self.device)[:, None]  # [n, 1]
            causal = {"attn_mask": torch.arange(kv_len, device=self.device)[None, :] <= rows}
        gqa = {"enable_gqa": True} if _SDPA_GQA else {}
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, scale=self.scale, **causal, **gqa
        )  # [1, H, n, d]
        return out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim).to(self.dtype)


class LeanStore(RowPool):
    """The static key/value store of a target on the lean forward: one float32 tensor
    [rows, layers, 2, Hkv, max_len, d] made once; `open_row()` hands out a row as a LeanCache
    that writes into it and never grows (store.py has the same for Hugging Face's forward).

    A freed row keeps its keys and values until it is handed out again, with the token id of
    each position (`ids`, [rows, max_len]): `open_row(tokens)` hands out the free row that
    shares the longest prefix with `tokens` (a system prompt, a chat's earlier turns, the same
    prompt again) and keeps those positions, so the prefill computes only the rest. A prefix
    is kept only where it is bit for bit what the prefill would compute
    (`LeanCache.reusable_prefix`): the answer is the same as from a fresh row. Among rows
    sharing nothing it takes the one freed longest ago, so recent prefixes live longest. What a
    row held before it is handed out again goes to `kept` (`PrefixCache`, at most `kept_bytes`;
    0 keeps nothing), and a prompt whose longest match is there gets it copied into its row.
    """

    def __init__(
        self,
        model: Any,
        rows: int,
        max_len: int,
        fused_tokens: int = VERIFY_TOKENS,
        kept_bytes: int = 0,
    ):
        super().__init__(rows, max_len)
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run this model: {reason}")
        self.model, self.fused_tokens = model, fused_tokens
        self.residual = target_residual(model)
        layers, kv_heads, head_dim = kv_shape(model)
        device = next(model.parameters()).device
        self.kv = torch.empty(rows, layers, 2, kv_heads, max_len, head_dim, device=device)
        self.ids = torch.zeros(rows, max_len, dtype=torch.long, device=device)
        # [rows, max_len, W]: each position's feature where the model keeps them
        dtype = next(model.parameters()).dtype
        width = feature_width(model)
        self.features = (
            torch.empty(rows, max_len, width, dtype=dtype, device=device) if width else None
        )
        self._left: list[LeanCache | None] = [None] * rows  # a freed row's last cache
        self.kept = PrefixCache(kept_bytes)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.kv, self.ids, self.features)

    def open_row(self, tokens: Sequence[int] = (), parts: int | None = None) -> LeanCache:
        """A row for a sequence that starts with `tokens` (StoreFull when every row is
        taken), holding the longest prefix of them a free row can keep (`len()` of the
        cache: 0 when none). `parts`: the most positions each forward of its prefill will
        take, where the caller promises that (`LeanCache.keeps_prefix`)."""
        if not self.free_rows:
            self.take()  # raises StoreFull
        kept = {row: self._kept(row, tokens, parts) for row in self.free_order()}
        row = max(kept, key=kept.get)  # the first of the longest: freed longest ago on ties
        self.take(row)
        self._keep_left(row, kept[row])
        features = self.features[row] if self.features is not None else None
        cache = LeanCache(
            self.model,
            self.fused_tokens,
            kv=self.kv[row],
            ids=self.ids[row],
            reused=kept[row],
            release=lambda cache: self._free_row(row, cache),
            residual=self.residual,
            features=features,
        )
        entry, length = self.kept.match(tokens) if len(self.kept) else (None, 0)
        if entry is not None and length > kept[row] and cache.keeps_prefix(len(tokens), parts):
            self.kept.restore(entry, length, self.kv[row], self.ids[row], features)
            cache.length = cache.fused_len = length
        return cache

    def _keep_left(self, row: int, staying: int) -> None:
        """Before `row` is handed out keeping `staying` positions: what else it held goes to
        `kept` (its positions computed on the fused path, the ones a prompt may keep)."""
        left, self._left[row] = self._left[row], None
        if left is None or left.fused_len <= staying or not self.kept.budget:
            return
        n = left.fused_len
        features = self.features[row, :n] if self.features is not None else None
        self.kept.keep(self.ids[row, :n], self.kv[row], features)

    def _kept(self, row: int, tokens: Sequence[int], parts: int | None) -> int:
        left = self._left[row]
        return left.reusable_prefix(tokens, parts) if left is not None and tokens else 0

    def _free_row(self, row: int, cache: LeanCache) -> None:
        self._left[row] = cache
        self.give_back(row)


class PrefixPool:
    """The draft caches that ended sequences leave behind (`DraftModelState.end`, in
    drafters/model.py), for the next sequences to start from: the `size` most recent, and
    older ones while all of them take at most `budget` bytes. `take(tokens, parts)` hands out
    the one holding the longest prefix of `tokens` that is bit for bit what a prefill would
    compute (at once, or in `parts`: `LeanCache.reusable_prefix`), rolled back to it; None when
    none holds any. A batch
    session's rows share one (runtime/session.py), as its target rows share the store and its
    `PrefixCache`."""

    def __init__(self, size: int, budget: int = 0) -> None:
        self.size, self.budget = size, budget
        self.nbytes = 0
        self._caches: list[LeanCache] = []  # oldest first

    def __len__(self) -> int:
        return len(self._caches)

    def longest(self, tokens: Sequence[int], parts: int | None = None) -> int:
        """The most positions `take(tokens, parts)` would keep (0: none)."""
        return max((cache.reusable_prefix(tokens, parts) for cache in self._caches), default=0)

    def take(self, tokens: Sequence[int], parts: int | None = None) -> LeanCache | None:
        kept = [cache.reusable_prefix(tokens, parts) for cache in self._caches]
        if not kept or max(kept) == 0:
            return None
        best = max(range(len(kept)), key=kept.__getitem__)
        cache = self._caches.pop(best)
        self.nbytes -= cache.nbytes
        cache.rollback(kept[best])
        return cache

    def put(self, cache: KVCache | LeanCache) -> None:
        if not isinstance(cache, LeanCache) or (self.size == 0 and cache.nbytes > self.budget):
            return
        self._caches.append(cache)
        self.nbytes += cache.nbytes
        while len(self._caches) > self.size and self.nbytes > self.budget:
            self.nbytes -= self._caches.pop(0).nbytes


def layer_projections(layer: Any) -> tuple[torch.nn.Module, ...]:
    """A decoder layer's projections in the order the lean forward uses them:
    (q, k, v, o, gate, up, down)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )


def _layer_linears(layer: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """A decoder layer's projections (`layer_projections`) as `direct_linear` calls."""
    return tuple(direct_linear(module) for module in layer_projections(layer))


def _prefill_linears(layers: Sequence[Any]) -> list[tuple[Callable, ...]] | None:
    """Each layer's projections as `prefill_linear` calls where there is one, else as their
    `direct_linear` (a quantized target's int8 layers keep their tiles beside the 4-bit and
    6-bit ones on AMX); None where no projection has one (the panels and tiles are the faster for
    many rows on this machine)."""
    projections = [layer_projections(layer) for layer in layers]
    calls = [tuple(prefill_linear(m) for m in layer) for layer in projections]
    if all(c is None for layer in calls for c in layer):
        return None
    return [
        tuple(c if c is not None else direct_linear(m) for c, m in zip(cs, ms, strict=True))
        for cs, ms in zip(calls, projections, strict=True)
    ]


def _norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm's epsilon, under either name Hugging Face's norms give it."""
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def _native_layers(cache: LeanCache) -> Any:
    """The extension's `LeanLayers` over `cache`'s decoder layers, or None where a projection is
    not a kernel call (`direct_linear` gave the module itself): the same kernel calls in the
    same order as the loop in `_forward_rows`, without the interpreter between them."""
    ext = cache._fused
    if not all(isinstance(op, ext.LinearOp) for ops in cache._linears for op in ops):
        return None
    layers = [
        ext.LeanLayer(
            *ops,
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            _norm_eps(layer.input_layernorm),
            _norm_eps(layer.post_attention_layernorm),
        )
        for ops, layer in zip(cache._linears, cache.layers, strict=True)
    ]
    return ext.LeanLayers(layers, cache.scale, cache.residual != cache.dtype)


def _output_layer(head: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What computes the output layer's logits [M, V] from h [M, D]: the kernel call itself, and
    for a draft vocabulary (models/draft_vocab.py) the kept ids' call spread over the vocabulary."""
    if isinstance(head, DraftVocabHead):
        kept = direct_linear(head.inner)
        return lambda h: head.expand(kept(h))
    return direct_linear(head)


def _fused_ops(model: Any, dtype: torch.dtype, device: torch.device, head_dim: int) -> Any:
    """The compiled extension when its fused operations fit (bfloat16 on the CPU) and the model's
    linears already run on specdecode's kernels (`--kernel off` is respected), else None."""
    if dtype != torch.bfloat16 or device.type != "cpu" or head_dim % 2:
        return None

    if not any(on_kernel(module) for module in model.modules()):
        return None

    try:
        return extension()
    except KernelUnavailable:
        return None
