"""One engine step's paged-attention batch: what every attention call of the step's forward reads
(the step context's ``attention``, ``invariant_infer.model.step_context``), and the attention it runs
over the paged KV cache.

``invariant`` (a model wrapped by ``make_invariant``): the paged Triton kernel, bitwise equal to
the padded kernel ``model(...)`` uses, with the layer's sliding window and attention sinks.
Otherwise (stock, for benchmarks): torch SDPA per sequence, or an explicit softmax where the layer
has sinks (SDPA has no sink term); a window or a sink is honoured on both paths, never dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import paged_attention, write_kv
from ..model.attention import refuse_softcapping
from ..model.step_context import current_step


def paged_stock_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          sliding_window=None, **kwargs):
    """The attention function an unwrapped model runs in the engine (registered by the model runner)."""
    refuse_softcapping(kwargs, "engine")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return current_step().attention.attend(module.layer_idx, query, key, value, scale, sliding_window or 0,
                                           kwargs.get("s_aux")), None


@dataclass(frozen=True, eq=False)
class PagedBatch:
    """One step's paged-attention metadata, read by every attention call of the forward: device
    tensors (views of the model runner's persistent buffers) and the host ints the kernel's grid
    needs, all set before the forward."""
    k_caches: list[torch.Tensor | None]  # per layer [num_pages, page_size, Hkv, D] (None: no pages)
    v_caches: list[torch.Tensor | None]
    slot_mappings: tuple[torch.Tensor, ...]  # per KV cache group, int64 [T]: page * page_size + offset of each token
    query_starts: torch.Tensor     # int32 [S + 1]
    seq_lens: torch.Tensor         # int32 [S]: context length including this step's tokens
    block_tables: tuple[torch.Tensor, ...]  # per KV cache group, int32 [S, max_pages]
    layer_groups: list[int | None]  # each layer's KV cache group
    writes_kv: list[bool]          # per layer: False where it reads another layer's K/V (written there)
    max_query_len: int
    max_seq_len: int               # the longest context: it lets a GPU run the KV chunks in parallel
    host_query_starts: list[int]
    host_seq_lens: list[int]
    invariant: bool

    def attend(self, layer_idx: int, query, key, value, scale: float, window: int = 0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [1, Hq, T, D], k/v [1, Hkv, T, D] (this step's tokens) -> [1, T, Hq, D]; ``window`` > 0:
        each query sees its last ``window`` keys; ``sinks`` [Hq]: attention sinks."""
        q = query[0].transpose(0, 1)                  # [T, Hq, D]
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        group = self.layer_groups[layer_idx]
        block_tables = self.block_tables[group]
        if self.writes_kv[layer_idx]:
            write_kv(k, v, k_cache, v_cache, self.slot_mappings[group])
        if self.invariant:
            out = paged_attention(q.contiguous(), k_cache, v_cache, self.query_starts, self.seq_lens,
                                  block_tables, scale, max_query_len=self.max_query_len, window=window,
                                  sinks=sinks, max_seq_len=self.max_seq_len)
            return out[None]
        return self._stock_attend(q, k_cache, v_cache, block_tables, scale, window, sinks)[None]

    def _stock_attend(self, q, k_cache, v_cache, block_tables, scale, window, sinks):
        page_size = k_cache.shape[1]
        out = torch.empty_like(q)
        for s, seq_len in enumerate(self.host_seq_lens):
            q0, q1 = self.host_query_starts[s], self.host_query_starts[s + 1]
            # From the page of the first query's earliest key: a window's earlier pages may be freed.
            first = max(0, seq_len - (q1 - q0) - window + 1) // page_size * page_size if window else 0
            pages = block_tables[s, first // page_size:-(-seq_len // page_size)]
            keys = k_cache[pages].flatten(0, 1)[:seq_len - first].transpose(0, 1)   # [Hkv, L, D]
            values = v_cache[pages].flatten(0, 1)[:seq_len - first].transpose(0, 1)
            positions = torch.arange(seq_len - (q1 - q0), seq_len, device=q.device)
            keys_at = torch.arange(first, seq_len, device=q.device)[None, :]
            visible = (keys_at <= positions[:, None]) & ((keys_at > positions[:, None] - window) | (window == 0))
            queries = q[q0:q1].transpose(0, 1)
            if sinks is None:
                attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scale,
                                                          enable_gqa=True)
            else:
                attended = _attend_with_sinks(queries, keys, values, visible, scale, sinks)
            out[q0:q1] = attended.transpose(0, 1)
        return out


def _attend_with_sinks(q, k, v, visible, scale, sinks):
    """transformers' eager sink attention: softmax over [scores, sink] per row, the sink's share dropped."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
