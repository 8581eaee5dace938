"""How the engine lays out the KV cache of a model's attention layers: layers of equal cache spec
(``invariant_infer.model.cache_specs``) form KV cache groups of ``group_size`` layers each, and one
page of the one page pool holds ``page_size`` tokens of K and V for every layer of a group. So every
page has the same bytes and any free page can serve any group.

``group_size`` is the gcd of the attention layer counts of the model's specs: every group is whole,
no page carries bytes for a layer it lacks (vLLM instead takes the smallest count and pads the other
groups' last one). A model whose attention is all one spec (full attention, or Mistral's window on
every layer) has one group of all its attention layers: one page per ``page_size`` tokens of the
whole model, as before groups existed. Gemma 3 (5 sliding : 1 full) groups its layers one spec per
group, in sixes or fewer; gpt-oss (alternating) one sliding and one full group per pair of layers,
or larger where the counts allow.

Position ``j`` of every group shares one K and one V tensor ``[pages, page_size, Hkv, D]``: layer
(group g, position j) reads and writes tensor j through group g's block table; where the spec's
values are its keys (``value_is_key``: multi-head latent attention's one latent per token) the two
are one tensor, so a page holds the latent once. Its pages are managed as full attention's (every
page of the context). Linear-attention layers hold no pages (their state is per sequence:
``linear_state``).

``pages_held`` is a request's page need per spec, the engine's own accounting (admission refusal,
benchmarks): full attention holds every page of its context; a window holds the pages its next
chunk's queries see, and a step's chunk besides (the engine shortens chunks under windows to the
free pages, so a request needs only its windows and one token's pages to run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import torch

from ..errors import UnsupportedModelError
from ..model.cache_specs import AttentionSpec, SlidingWindowSpec, cache_specs


@dataclass(frozen=True)
class KVCacheGroup:
    spec: AttentionSpec
    layers: tuple[int, ...]   # decoder layer indices; layers[j] uses K/V tensor j


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    group_size: int   # layers per group: K/V tensors per position

    @property
    def group_specs(self) -> tuple[AttentionSpec, ...]:
        return tuple(group.spec for group in self.groups)

    def place(self, layer: int) -> tuple[int, int] | None:
        """(group, position) of an attention layer; None for a layer without pages."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        return None

    def page_bytes(self, dtype: torch.dtype, page_size: int, tp_size: int = 1) -> int:
        """Bytes of one page on one rank (a rank holds 1 / tp_size of the KV heads)."""
        spec = self.groups[0].spec
        return self.group_size * page_size * spec.kv_bytes_per_token(dtype, tp_size)

    def pages_for_request(self, context: int, page_size: int, chunk: int = 1) -> list[int]:
        """Per group, the most pages one request of ``context`` tokens holds at once, its steps
        bringing at most ``chunk`` tokens each."""
        return [pages_held(group.spec, context, page_size, chunk) for group in self.groups]


def pages_held(spec: AttentionSpec, context: int, page_size: int, chunk: int = 1) -> int:
    """The most pages a sequence of ``context`` tokens holds at once in a group of ``spec``, each
    step bringing at most ``chunk`` tokens: full attention, every page of the context; a window
    ``w``, the pages from its chunk's first query's earliest key (start - w + 1) to the chunk's
    end, at most (chunk + w - 2) // page_size + 2, and never more than its context's."""
    whole = -(-context // page_size)
    if isinstance(spec, SlidingWindowSpec):
        chunk = max(1, min(chunk, context))
        return min(whole, (chunk + spec.window - 2) // page_size + 2)
    return whole


def kv_cache_layout(config) -> KVCacheLayout:
    """The layout of a supported model's config (a vision-language config: its text model's)."""
    by_spec: dict[AttentionSpec, list[int]] = {}
    for layer, spec in enumerate(cache_specs(config)):
        if isinstance(spec, AttentionSpec):
            by_spec.setdefault(spec, []).append(layer)
    if not by_spec:
        raise UnsupportedModelError("the engine needs at least one attention layer")
    shapes = {(spec.num_kv_heads, spec.head_dim) for spec in by_spec}
    if len(shapes) > 1:  # pages of one pool must have one size
        raise UnsupportedModelError(f"attention layers of different K/V shapes {sorted(shapes)}: the engine's page "
                                    "pool holds one shape")
    if len(by_spec) == 1:
        spec, layers = next(iter(by_spec.items()))
        return KVCacheLayout((KVCacheGroup(spec, tuple(layers)),), len(layers))
    size = reduce(math.gcd, (len(layers) for layers in by_spec.values()))
    groups = [KVCacheGroup(spec, tuple(layers[i:i + size]))
              for spec, layers in by_spec.items() for i in range(0, len(layers), size)]
    return KVCacheLayout(tuple(groups), size)

