"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next) on the invariant kernels: each sequence's chunks start at
its first real token, and a forward that continues a cached sequence runs the rows since its last
chunk boundary again (``kernels.gated_delta_rule``), so decode, a prefill cut anywhere and one
forward over the whole prefix give every token the same bits.

The layer's cache state, per sequence: the last K inputs of the short convolution (kept in the
transformers cache's own conv state, which also counts the tokens), the fp32 state at the last
chunk boundary and the inputs (q, k, v, a, b after the convolution) of the chunk not yet complete,
right-aligned in a [B, CHUNK - 1] buffer. Both live on the layer's own entry in the transformers
cache (``cache.layers[layer_idx]``, a ``LinearAttentionLayer`` in transformers 5.17 and 5.25, which
the cache never replaces), as one ``LinearAttentionState``: they live and die with the cache, and a
copy of the cache copies them.

Rows: a padded batch's real tokens are one run per row (left or right padding); pads never enter a
chunk or a state. Packed rows (``PACKED_KWARG``) give one segment per sequence, and are whole
sequences: a cache passed with them is left as it is.

A serving engine's step (``step_context.current_step()`` with a ``LinearAttentionStep``) keeps
the same per-sequence state in the engine's slots (``engine.linear_state_slots``), one per sequence, and runs the same
computation: the convolution over the slot's last K - 1 inputs and the new ones, the scan over the
unfinished chunk's rows and the new ones from the boundary state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NonInvariantInputError
from ..kernels import causal_conv1d_silu, chunk_gated_delta_rule, rms_norm_gated
from ..kernels.gated_delta_rule import CHUNK
from .no_backward import without_backward
from .recomputed_backward import recomputed_backward
from .packing import PACKED_KWARG
from .step_context import LinearAttentionStep, current_step

HISTORY = CHUNK - 1  # the most rows of an unfinished chunk


@dataclass
class LinearAttentionState:
    """One layer's per-sequence state beside a transformers cache (see the module's docstring)."""
    state: torch.Tensor     # fp32 [B, Hv, Dk, Dv]: the state at each sequence's last chunk boundary
    rows: torch.Tensor      # [B, HISTORY, conv_dim + 2 Hv]: the unfinished chunk's q|k|v|a|b, right-aligned
    count: torch.Tensor     # long [B]: rows of the unfinished chunk
    right_padded: torch.Tensor | None = None  # bool []: a forward ended some row before its last column


_STATE_ATTRIBUTE = "invariant_linear_attention_state"  # on a transformers cache's linear-attention layer


def _state_of(cache, layer_idx: int) -> LinearAttentionState | None:
    return getattr(cache.layers[layer_idx], _STATE_ATTRIBUTE, None)


def _states_of(cache) -> list[LinearAttentionState]:
    """The states of every layer of ``cache`` that holds one."""
    layers = getattr(cache, "layers", None) or []
    return [state for layer in layers if (state := getattr(layer, _STATE_ATTRIBUTE, None)) is not None]


def check_cache_continuation(cache, attention_mask: torch.Tensor | None, length: int) -> None:
    """Raise unless a forward of ``length`` new tokens (2-D ``attention_mask`` over the cached and new
    columns, or None) may continue ``cache``'s sequences: none ended before its last column, and no
    row's new tokens start after padding while an unfinished chunk is held. Read at the call's entry
    point (one host sync), not inside the layers' forward."""
    states = _states_of(cache)
    if not states:
        return
    mask = attention_mask[:, -length:] if attention_mask is not None and length > 1 else None  # as transformers
    flags = []
    for layer_state in states:
        start, _ = _row_ranges(mask, layer_state.count.shape[0], length, layer_state.count.device)
        flags.append(((layer_state.count > 0) & (start > 0)).any())
        if layer_state.right_padded is not None:
            flags.append(layer_state.right_padded)
    if bool(torch.stack(flags).any()):
        raise NonInvariantInputError("a cached sequence continued after right padding, or with padding before "
                                     "its new tokens: pad prompts on the left, in the first forward only")


def _row_ranges(mask: torch.Tensor | None, batch: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) long [B]: each row's run of real tokens among this forward's ``length`` columns."""
    if mask is None:
        return (torch.zeros(batch, dtype=torch.long, device=device),
                torch.full((batch,), length, dtype=torch.long, device=device))
    mask = mask.to(torch.long)
    count = mask.sum(-1)
    start = torch.where(count > 0, mask.argmax(-1), length)
    return start, start + count


def _update_conv_state(cache, layer_idx: int, x: torch.Tensor, kernel: int) -> torch.Tensor:
    """transformers' own conv-state update ([B, C, L] in, the cached inputs and the new ones out),
    which also counts the layer's tokens for ``cache.get_seq_length``."""
    return cache.update_conv_state(x, layer_idx, conv_kernel_size=kernel)


def gated_delta_net_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, cache_params=None,
                            **kwargs) -> torch.Tensor:
    """The invariant forward of a ``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet`` layer."""
    context = current_step()
    step = context.linear_attention if context is not None else None
    if step is not None:
        return _engine_step_forward(self, hidden_states, step)
    packed = kwargs.get(PACKED_KWARG)
    # Packed rows (training, scoring) are whole sequences: nothing continues them through a cache.
    cache = None if packed is not None else cache if cache is not None else cache_params
    batch, length, _ = hidden_states.shape
    device = hidden_states.device
    hv, dk, dv = self.num_v_heads, self.head_k_dim, self.head_v_dim
    value_dim = self.value_dim

    start, end = _row_ranges(attention_mask if packed is None else None, batch, length, device)
    real = (torch.arange(length, device=device)[None, :] >= start[:, None]) & \
        (torch.arange(length, device=device)[None, :] < end[:, None])
    mixed, z, a, b = _projections(self, hidden_states)
    mixed = mixed * real[..., None].to(hidden_states.dtype)  # pads are zeros
    kernel = self.conv_kernel_size
    weight = self.conv1d.weight.squeeze(1)

    # The short convolution over each row (cached inputs first), outputs for this forward's columns.
    conv_in = mixed.transpose(1, 2) if cache is None else \
        _update_conv_state(cache, self.layer_idx, mixed.transpose(1, 2), kernel)
    width = conv_in.shape[-1]
    flat = conv_in.transpose(1, 2).reshape(batch * width, -1)
    row_base = torch.arange(batch, device=device, dtype=torch.long) * width
    if packed is not None:
        starts, ends = _packed_segments(packed)
        conv = causal_conv1d_silu(flat, weight, starts, ends)
    else:
        conv = causal_conv1d_silu(flat, weight, row_base.to(torch.int32), (row_base + width).to(torch.int32),
                                  (row_base + width - length).to(torch.int32))
    qkv = conv.view(batch, width, -1)[:, width - length:]

    # The gated delta rule: the unfinished chunk's rows, then this forward's.
    rows = torch.cat([qkv, a, b], dim=-1)
    continued = False  # a cached sequence continued: its earlier tokens are not this forward's inputs
    if packed is not None:
        seg_start, seg_end = _packed_segments(packed)
        state = torch.zeros(seg_start.shape[0], hv, dk, dv, device=device)
        core = _scan(self, rows.reshape(batch * length, -1), seg_start, seg_end, seg_start, state)
        core = core.view(batch, length, hv, dv)
    else:
        layer_state = _state_of(cache, self.layer_idx) if cache is not None else None
        continued = layer_state is not None
        if layer_state is None:
            layer_state = LinearAttentionState(torch.zeros(batch, hv, dk, dv, device=device),
                                               rows.new_zeros(batch, HISTORY, rows.shape[-1]),
                                               torch.zeros(batch, dtype=torch.long, device=device))
        all_rows = torch.cat([layer_state.rows, rows], dim=1)                  # [B, HISTORY + L, C]
        span = HISTORY + length
        base = torch.arange(batch, device=device, dtype=torch.long) * span
        seg_from = base + HISTORY + start
        seg_start = torch.where(layer_state.count > 0, base + HISTORY - layer_state.count, seg_from)
        seg_end = base + HISTORY + end
        out = _scan(self, all_rows.reshape(batch * span, -1), seg_start, seg_end, seg_from, layer_state.state)
        core = out.view(batch, span, hv, dv)[:, HISTORY:]
        if cache is not None:  # the new unfinished chunk: the last (rows since the boundary) % CHUNK rows
            count = (seg_end - seg_start) % CHUNK
            slots = torch.arange(HISTORY, device=device)
            source = (seg_end - HISTORY)[:, None] - base[:, None] + slots[None, :]
            keep = slots[None, :] >= HISTORY - count[:, None]
            gathered = all_rows.gather(1, source.clamp(0, span - 1)[..., None].expand(-1, -1, all_rows.shape[-1]))
            layer_state.rows = torch.where(keep[..., None], gathered, torch.zeros((), dtype=rows.dtype, device=device))
            layer_state.count = count
            layer_state.right_padded = (end < length).any()  # refused at the next call's entry (input_checks.py)
            setattr(cache.layers[self.layer_idx], _STATE_ATTRIBUTE, layer_state)
    normed = rms_norm_gated(core, z.view(batch, length, hv, dv), self.norm.weight, self.norm.variance_epsilon)
    if continued:
        normed = without_backward(normed, [hidden_states, *self.parameters()],
                                  "a Gated DeltaNet forward that continues a cached sequence (Qwen3.5, Qwen3-Next)")
    elif torch.is_grad_enabled():  # training: the backward differentiates a recomputation
        if packed is not None:
            segments = list(zip(seg_start.tolist(), seg_end.tolist()))
        else:
            segments = [(row * length + s, row * length + e)
                        for row, (s, e) in enumerate(zip(start.tolist(), end.tolist()))]
        normed = recomputed_backward(normed, _reference_core(self, segments, normed.shape), mixed, z, a, b,
                                     self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
    return self.out_proj(normed.reshape(batch, length, value_dim))


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # the eps inside the root, as the kernel


def _reference_core(self, segments: list[tuple[int, int]], shape):
    """The layer's convolution, gated delta rule and gated RMSNorm as differentiable torch in fp32 (the
    recurrence token by token), on each segment of the flattened [B * L] rows: what the backward of
    the kernels' output differentiates. Rows outside every segment are zero."""
    hv, dk, dv, eps = self.num_v_heads, self.head_k_dim, self.head_v_dim, self.norm.variance_epsilon
    group = hv // self.num_k_heads

    def reference(mixed, z, a, b, conv_weight, a_log, dt_bias, norm_weight):
        work = torch.promote_types(mixed.dtype, torch.float32)  # fp32, or fp64 where checked against stock's
        mixed, z, a, b = (x.reshape(-1, x.shape[-1]).to(work) for x in (mixed, z, a, b))
        kernel = conv_weight.shape[-1]
        out = torch.zeros(shape[0] * shape[1], hv, dv, device=mixed.device, dtype=work)
        for first, last in segments:
            if last <= first:
                continue
            x = mixed[first:last].t()[None]
            conv = torch.nn.functional.conv1d(x, conv_weight.to(work), padding=kernel - 1, groups=x.shape[1])
            conv = torch.nn.functional.silu(conv[0, :, :last - first]).t()
            q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q, k = (_l2_normalize(t.reshape(-1, self.num_k_heads, dk)).repeat_interleave(group, dim=1) for t in (q, k))
            q = q * dk ** -0.5
            v = v.reshape(-1, hv, dv)
            decay = torch.exp(-a_log.to(work).exp() * torch.nn.functional.softplus(a[first:last] + dt_bias.to(work)))
            beta = torch.sigmoid(b[first:last])
            state, rows = torch.zeros(hv, dk, dv, device=mixed.device, dtype=work), []
            for t in range(last - first):
                state = state * decay[t, :, None, None]
                delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t, :, None]
                state = state + k[t, :, :, None] * delta[:, None, :]
                rows.append(torch.einsum("hk,hkv->hv", q[t], state))
            core = torch.stack(rows)
            normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + eps)
            gate = z[first:last].reshape(-1, hv, dv)
            out = out.index_copy(0, torch.arange(first, last, device=out.device),
                                 normed * norm_weight.to(work) * torch.nn.functional.silu(gate))
        return out.view(shape)
    return reference


def _projections(self, hidden_states: torch.Tensor):
    """(q|k|v before the convolution, z, a, b) of [B, L, H] hidden states: Qwen3.5's four projections,
    or Qwen3-Next's two fused ones, interleaved per key head and taken apart by the module's own
    ``fix_query_key_value_ordering`` (views and splits: no arithmetic)."""
    if hasattr(self, "in_proj_qkvz"):
        query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                      self.in_proj_ba(hidden_states))
        mixed = torch.cat([x.flatten(2) for x in (query, key, value)], dim=-1)
        return mixed, z.flatten(2), a, b
    return (self.in_proj_qkv(hidden_states), self.in_proj_z(hidden_states), self.in_proj_a(hidden_states),
            self.in_proj_b(hidden_states))


def _scan(self, rows: torch.Tensor, seg_start, seg_end, seg_from, state: torch.Tensor) -> torch.Tensor:
    key_dim, value_dim, hv = self.key_dim, self.value_dim, self.num_v_heads
    q, k, v, a, b = torch.split(rows, [key_dim, key_dim, value_dim, hv, hv], dim=-1)
    tokens = rows.shape[0]
    return chunk_gated_delta_rule(
        q.reshape(tokens, -1, self.head_k_dim), k.reshape(tokens, -1, self.head_k_dim),
        v.reshape(tokens, hv, self.head_v_dim), a, b, self.A_log, self.dt_bias,
        seg_start.to(torch.int32), seg_end.to(torch.int32), state, out_from=seg_from.to(torch.int32))


def _packed_segments(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (start, end) over the flattened packed tokens of each packed sequence."""
    first = packed.slot_tokens[torch.arange(packed.sequences, device=packed.lengths.device) * packed.width]
    return first.to(torch.int32), (first + packed.lengths).to(torch.int32)



# ---- a serving engine's step ------------------------------------------------------------------------

def _engine_step_forward(self, hidden_states: torch.Tensor, step: LinearAttentionStep) -> torch.Tensor:
    """``hidden_states`` [1, T, H]: the step's packed tokens."""
    tokens = hidden_states.shape[1]
    hv, layer = self.num_v_heads, self.layer_idx
    slots, ids, fresh = step.slots, step.slot_ids, step.fresh
    mixed, z, a, b = (x[0] for x in _projections(self, hidden_states))

    # The convolution over each slot's last K - 1 inputs (zeros for a fresh sequence), then the new ones.
    c = step.conv
    history = slots.conv[layer].index_select(0, ids).masked_fill_(fresh[:, None, None], 0)
    conv_in = mixed.new_empty(c["total"], mixed.shape[-1])
    conv_in[c["history_at"]] = history.flatten(0, 1)
    conv_in[c["new_at"]] = mixed
    conv = causal_conv1d_silu(conv_in, self.conv1d.weight.squeeze(1), c["start"].to(torch.int32),
                              c["end"].to(torch.int32), c["out_from"].to(torch.int32))

    # The scan from each slot's boundary state over its unfinished chunk's rows, then the new ones.
    r = step.scan
    rows = torch.cat([conv[c["new_at"]], a, b], dim=-1)
    scan_in = rows.new_zeros(r["total"], rows.shape[-1])
    scan_in[r["history_at"]] = slots.rows[layer].index_select(0, ids).flatten(0, 1)
    scan_in[r["new_at"]] = rows
    state = slots.state[layer].index_select(0, ids).masked_fill_(fresh[:, None, None, None], 0)
    core = _scan(self, scan_in, r["start"], r["end"], r["out_from"], state)[r["new_at"]]
    unfinished = torch.where(step.keep[..., None], scan_in[r["tail_at"]], torch.zeros((), dtype=rows.dtype,
                                                                                     device=rows.device))
    step.updates[layer] = (conv_in[c["tail_at"]], state, unfinished)

    normed = rms_norm_gated(core, z.view(tokens, hv, self.head_v_dim), self.norm.weight, self.norm.variance_epsilon)
    return self.out_proj(normed.reshape(1, tokens, self.value_dim))
