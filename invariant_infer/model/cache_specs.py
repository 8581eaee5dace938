"""What each decoder layer keeps per sequence between forwards: its cache spec, derived once from the
config through the family adapter, and the one answer to "which layers are attention, windowed or
linear attention" for every other part of the project.

Kinds:
  * ``FullAttentionSpec``: K and V of every token;
  * ``SlidingWindowSpec``: K and V of the last ``window`` tokens only (a query sees its last
    ``window`` keys, itself included), so older ones may be dropped;
  * ``LinearStateSpec``: a Gated DeltaNet layer's fixed-size state (the short convolution's last
    inputs, the fp32 state at the last chunk boundary, and the unfinished chunk's rows), whatever the
    sequence's length.

  * ``LatentAttentionSpec``: multi-head latent attention (DeepSeek-V3): one [kv_lora_rank +
    qk_rope_head_dim] vector per token, the key every head shares and its own value (``value_is_key``);
  * ``SharedKVSpec``: no cache of its own; the layer attends over the K/V that an earlier layer
    (``source``) computed and keeps (Gemma 4's ``num_kv_shared_layers``).

A further kind is one more spec class here and one more manager in the engine; nothing else branches
on the kind.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import FAMILIES, family_of, text_config


@dataclass(frozen=True)
class AttentionSpec:
    """A layer that keeps K and V per token: ``num_kv_heads`` heads of ``head_dim`` each."""
    num_kv_heads: int
    head_dim: int
    # Whether a layer's values are its keys (one tensor per token): its pages hold one tensor, read as both.
    value_is_key = False

    def kv_bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes of one token's K and V on one rank (a rank holds 1 / tp_size of the KV heads)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * (self.num_kv_heads // tp_size) * self.head_dim * element

    def tokens_held(self, context: int) -> int:
        """Tokens whose K/V a sequence of ``context`` tokens must still hold for its next query."""
        return context


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """K and V of every token."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """K and V of the last ``window`` tokens: a query at position p sees keys (p - window, p]."""
    window: int = 0

    def tokens_held(self, context: int) -> int:
        return min(context, self.window)


@dataclass(frozen=True)
class LatentAttentionSpec(AttentionSpec):
    """Absorbed multi-head latent attention (``model.latent_attention``): every token's latent and rope key,
    [c, k_rope] of ``head_dim`` = kv_lora_rank + qk_rope_head_dim, is the one key all heads share
    (``num_kv_heads`` 1) and the value too, so a token holds one vector, not a K and a V."""
    value_is_key = True

    def kv_bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes of one token's latent (unsharded: tensor parallelism does not run these layers)."""
        return self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class LinearStateSpec:
    """A Gated DeltaNet layer's state per sequence (its size does not grow with the context)."""
    conv_dim: int          # channels of the short convolution (q, k and v)
    conv_kernel: int       # the convolution's width: it keeps the last conv_kernel - 1 inputs
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    def state_bytes(self, dtype: torch.dtype, history: int) -> int:
        """Bytes of one sequence's state: ``history`` rows of the unfinished chunk (conv_dim + 2 Hv
        each, in ``dtype``), the convolution's inputs, and the fp32 boundary state."""
        element = torch.empty((), dtype=dtype).element_size()
        rows = history * (self.conv_dim + 2 * self.num_v_heads) * element
        conv = (self.conv_kernel - 1) * self.conv_dim * element
        return rows + conv + 4 * self.num_v_heads * self.head_k_dim * self.head_v_dim


@dataclass(frozen=True)
class SharedKVSpec:
    """A layer that reads layer ``source``'s K/V (same window, same shape) and keeps none of its own."""
    source: int


LayerCacheSpec = FullAttentionSpec | SlidingWindowSpec | LatentAttentionSpec | LinearStateSpec | SharedKVSpec


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_shape(config, layer: int) -> tuple[int, int]:
    """(KV heads, head_dim) of an attention layer: the config's, or its per-layer override (Gemma 4's
    global layers: ``per_layer_config[layer]``)."""
    overrides = getattr(config, "per_layer_config", None)  # every config has the view (transformers 5.17 on)
    layer_config = overrides[layer] if overrides is not None else config
    return (getattr(layer_config, "num_key_value_heads", None) or config.num_key_value_heads,
            getattr(layer_config, "head_dim", None) or _head_dim(config))


def kv_source_layers(config) -> dict[int, int]:
    """{layer: the layer whose K/V it reads} for the layers that keep none (Gemma 4's last
    ``num_kv_shared_layers``: each reads the last earlier layer of its type that keeps K/V)."""
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if not shared:
        return {}
    kinds = config.layer_types[:config.num_hidden_layers]
    first = config.num_hidden_layers - shared
    return {layer: max(i for i in range(first) if kinds[i] == kinds[layer]) for layer in range(first, len(kinds))}


def _linear_state_spec(config) -> LinearStateSpec:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    return LinearStateSpec(conv_dim=2 * key_dim + value_dim, conv_kernel=config.linear_conv_kernel_dim,
                           num_v_heads=config.linear_num_value_heads, head_k_dim=config.linear_key_head_dim,
                           head_v_dim=config.linear_value_head_dim)


def cache_specs(config) -> tuple[LayerCacheSpec, ...]:
    """One spec per decoder layer of a supported family's config (a vision-language config: its text
    model's). ``UnsupportedModelError`` for another family."""
    adapter = family_of(config)
    text = text_config(config)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    every_layer = adapter.window_on_every_layer and window is not None
    sources = kv_source_layers(text)
    specs: list[LayerCacheSpec] = []
    for layer, kind in enumerate(kinds[:text.num_hidden_layers]):
        heads, head_dim = attention_shape(text, layer)
        if adapter.latent_attention is not None:
            specs.append(LatentAttentionSpec(1, text.kv_lora_rank + text.qk_rope_head_dim))
        elif layer in sources:
            specs.append(SharedKVSpec(sources[layer]))
        elif kind == "linear_attention":
            specs.append(_linear_state_spec(text))
        elif window is not None and (kind == "sliding_attention" or every_layer):  # no window: full attention
            specs.append(SlidingWindowSpec(heads, head_dim, window=int(window)))
        else:
            specs.append(FullAttentionSpec(heads, head_dim))
    return tuple(specs)


def attention_head_dims(config) -> set[int]:
    """The head dims the attention kernels run at (a latent layer's: latent + rope; Gemma 4's global
    layers: their own): every attention layer's spec's; a config outside the registered families (a
    vision-language model's text config): its own head dim."""
    specs = [spec for spec in cache_specs(config) if isinstance(spec, AttentionSpec)] \
        if getattr(config, "model_type", None) in FAMILIES else []
    return {spec.head_dim for spec in specs} or {_head_dim(text_config(config))}


def linear_attention_layers(config) -> list[int]:
    """Indices of the layers that keep a linear-attention state."""
    return [i for i, spec in enumerate(cache_specs(config)) if isinstance(spec, LinearStateSpec)]


def attention_layers(config) -> list[int]:
    """Indices of the layers that keep K/V (full or windowed)."""
    return [i for i, spec in enumerate(cache_specs(config)) if isinstance(spec, AttentionSpec)]


def is_hybrid(config) -> bool:
    return bool(linear_attention_layers(config))
