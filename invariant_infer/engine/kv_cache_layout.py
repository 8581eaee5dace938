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
``linear_state``); a layer that reads another layer's K/V (``SharedKVSpec``, Gemma 4) holds none
either and reads its source's tensors.

Specs of different K/V shapes (Gemma 4's global layers: their own head_dim and KV heads) keep the
one pool by a page-bytes rule: a spec's groups hold as many layers as make a page the same bytes as
every other group's (Gemma 4 31B: 5 sliding layers of 16 x 256 or 10 global ones of 4 x 512 per
group), so any free page still serves any group. The pages are then one buffer ``[pages, page
bytes]`` that each group views in its own shape (``allocate``); a layout whose specs all have one
shape keeps its contiguous per-position tensors. Where no whole groups give equal pages (Gemma 4
26B-A4B: 25 sliding layers of 8 x 256, 5 global ones of 2 x 512, half the bytes a token), a spec's
last group is padded: its pages have room (``slots``) for more layers than it holds, the fewest
padded bytes per token (26B-A4B: groups of 1 sliding layer, global groups of 2, 2 and 1 in room for 2).

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
from ..model.cache_specs import AttentionSpec, SharedKVSpec, SlidingWindowSpec, cache_specs


@dataclass(frozen=True)
class KVCacheGroup:
    spec: AttentionSpec
    layers: tuple[int, ...]   # decoder layer indices; layers[j] uses K/V tensor j
    slots: int                # layers a page has room for: len(layers), more in a padded group

    def bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes of one token in one of the group's pages on one rank (its padding included)."""
        return self.slots * self.spec.kv_bytes_per_token(dtype, tp_size)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    group_size: int   # K/V tensors per position: the most layers a group holds
    # {layer: its source layer} for the layers that read another's K/V and hold no pages
    shared: tuple[tuple[int, int], ...] = ()

    @property
    def group_specs(self) -> tuple[AttentionSpec, ...]:
        return tuple(group.spec for group in self.groups)

    def place(self, layer: int) -> tuple[int, int] | None:
        """(group, position) of an attention layer (a KV-shared layer: its source's); None for a layer
        without pages."""
        layer = dict(self.shared).get(layer, layer)
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        return None

    def writes_kv(self, layer: int) -> bool:
        """Whether the layer writes its K/V into the pages (a KV-shared layer reads its source's)."""
        return layer not in dict(self.shared)

    def page_bytes(self, dtype: torch.dtype, page_size: int, tp_size: int = 1) -> int:
        """Bytes of one page on one rank (a rank holds 1 / tp_size of the KV heads): the same for every group."""
        return page_size * self.groups[0].bytes_per_token(dtype, tp_size)

    def allocate(self, num_pages: int, page_size: int, dtype: torch.dtype, device, num_layers: int, tp_size: int = 1):
        """(K caches, V caches) per decoder layer, ``[num_pages, page_size, Hkv, D]`` each (None for a
        layer without pages): one K and one V tensor per position when every spec has one shape, else
        views of one ``[num_pages, page bytes]`` buffer, each group in its shape."""
        shapes = {(spec.num_kv_heads // tp_size, spec.head_dim, spec.value_is_key) for spec in self.group_specs}
        if len(shapes) == 1:
            heads, head_dim, value_is_key = next(iter(shapes))
            shape = (num_pages, page_size, heads, head_dim)
            k_tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.group_size)]
            v_tensors = k_tensors if value_is_key else \
                [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.group_size)]
            group_k, group_v = [k_tensors] * len(self.groups), [v_tensors] * len(self.groups)
        else:
            element = torch.empty((), dtype=dtype).element_size()
            pages = torch.zeros(num_pages, self.page_bytes(dtype, page_size, tp_size) // element, dtype=dtype,
                                device=device)
            group_k, group_v = [], []
            for group in self.groups:
                planes = 1 if group.spec.value_is_key else 2  # a latent: K and V are one tensor
                shape = (len(group.layers), planes, page_size, group.spec.num_kv_heads // tp_size, group.spec.head_dim)
                view = pages[:, :math.prod(shape)].view(num_pages, *shape)  # a padded group: its pages' first bytes
                group_k.append([view[:, j, 0] for j in range(len(group.layers))])
                group_v.append([view[:, j, planes - 1] for j in range(len(group.layers))])
        places = [self.place(layer) for layer in range(num_layers)]
        return ([group_k[p[0]][p[1]] if p else None for p in places],
                [group_v[p[0]][p[1]] if p else None for p in places])

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
    shared = []
    for layer, spec in enumerate(cache_specs(config)):
        if isinstance(spec, AttentionSpec):
            by_spec.setdefault(spec, []).append(layer)
        elif isinstance(spec, SharedKVSpec):
            shared.append((layer, spec.source))
    if not by_spec:
        raise UnsupportedModelError("the engine needs at least one attention layer")
    sizes = _group_sizes({spec: len(layers) for spec, layers in by_spec.items()})
    groups = [KVCacheGroup(spec, tuple(layers[i:i + sizes[spec]]), sizes[spec])
              for spec, layers in by_spec.items() for i in range(0, len(layers), sizes[spec])]
    return KVCacheLayout(tuple(groups), max(sizes.values()), tuple(shared))


def _group_sizes(counts: dict[AttentionSpec, int]) -> dict[AttentionSpec, int]:
    """Layers a group's pages have room for, for each spec: whole groups (a size divides the spec's
    layer count) whose pages have equal bytes (size x the spec's bytes per token, the same for every
    spec), as large as they come. One spec: all its layers; specs of one shape: the gcd of their counts.
    Where no whole groups exist, ``_padded_group_sizes``."""
    per_token = {spec: spec.kv_bytes_per_token(torch.float32) for spec in counts}
    if len(set(per_token.values())) == 1:
        size = reduce(math.gcd, counts.values())
        return {spec: size for spec in counts}
    first = next(iter(counts))
    for size in range(counts[first], 0, -1):  # the largest first
        page = size * per_token[first]
        if counts[first] % size or any(page % b or counts[s] % (page // b) for s, b in per_token.items()):
            continue
        return {spec: page // per_token[spec] for spec in counts}
    return _padded_group_sizes(counts, per_token)


def _padded_group_sizes(counts: dict[AttentionSpec, int], per_token: dict[AttentionSpec, int]) -> dict:
    """Room per group for each spec where every page holds a multiple of the least common multiple of
    the specs' bytes per token and a spec's last group may be padded: the fewest padded bytes per token
    (empty slots x their spec's bytes), then the largest pages (the fewest groups)."""
    unit = reduce(math.lcm, per_token.values())
    most = max(-(-counts[s] * b // unit) for s, b in per_token.items())  # a page holding the largest spec whole

    def padding(multiple: int) -> int:
        room = {s: multiple * unit // b for s, b in per_token.items()}
        return sum((-counts[s] % room[s]) * per_token[s] for s in counts)
    multiple = min(range(1, most + 1), key=lambda m: (padding(m), -m))
    return {spec: multiple * unit // b for spec, b in per_token.items()}
