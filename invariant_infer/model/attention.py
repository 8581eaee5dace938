"""The attention and mask functions registered with transformers under the name ``invariant`` (and the
encoders' bidirectional attention function, ``invariant_encoder``).

The mask function does not build a [B, 1, Lq, Lk] mask: it reduces the 2-D padding mask to
per-row bounds (first real key, end of real keys, position of the first query), which is
all the kernel needs to align its KV blocks to each row's first real token.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from ..errors import NonInvariantInputError
from ..kernels import attention, attention_autograd
from .packing import PACKED_KWARG
from .padding import is_sequence_bounds, sequence_bounds
from .step_context import current_step
from .support import require

ATTN_IMPLEMENTATION = "invariant"
ENCODER_ATTN_IMPLEMENTATION = "invariant_encoder"  # BERT / XLM-R self-attention: bidirectional


def invariant_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                   mask_function=causal_mask_function, attention_mask=None, device=None, **kwargs):
    """Mask builder for transformers' ``create_causal_mask`` and ``create_sliding_window_causal_mask``;
    returns ``sequence_bounds``. A sliding-window mask (``local_size``: the window, which the
    attention call gets as ``sliding_window``) comes with the cache's ``kv_offset``, the first key it
    still holds: the bounds are then indices into the keys held, kv_start possibly negative."""
    if device is None:
        device = attention_mask.device if attention_mask is not None else torch.device("cpu")
    if kwargs.get("local_size") is not None:
        return sequence_bounds(attention_mask, batch_size, kv_length, q_offset, device, kv_offset=kv_offset)
    if mask_function is not causal_mask_function:
        raise NonInvariantInputError(
            "invariant attention supports plain causal masks with 2-D padding and packed rows (position_ids "
            "restarting at 0, no attention_mask) checked before the forward; custom mask functions, and packed "
            "rows under torch.compile, are not supported.")
    if isinstance(kv_offset, int) and kv_offset != 0:
        raise NonInvariantInputError("invariant attention does not support KV offsets outside sliding-window layers")
    return sequence_bounds(attention_mask, batch_size, kv_length, q_offset, device)


def invariant_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """transformers attention function: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] -> ([B, Lq, Hq, D], None);
    ``sliding_window`` and attention sinks (``s_aux``, gpt-oss) as the kernels take them.

    Inside a serving engine's step (``step_context.current_step()``: its packed tokens, B = 1), K/V
    are written to the engine's paged cache and attention runs over each sequence's pages instead. With a
    ``packed_sequences`` keyword (packed rows, set by the model's pre-hook), q/k/v are regrouped
    one sequence per row and ``attention_mask`` holds that regrouped batch's bounds."""
    refuse_softcapping(kwargs)
    window, sinks = sliding_window or 0, kwargs.get("s_aux")
    step = current_step()
    if step is not None:
        if dropout:
            raise NonInvariantInputError("attention dropout is not batch-invariant; call model.eval()")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return step.attention.attend(module.layer_idx, query, key, value, scale, window, sinks), None
    if not is_sequence_bounds(attention_mask):
        raise NonInvariantInputError(
            "invariant attention needs the 2-D padding mask (or none); a prepared 4-D mask or a paged cache "
            f"was passed (got {None if attention_mask is None else tuple(attention_mask.shape)}).")
    if dropout:
        raise NonInvariantInputError("attention dropout is not batch-invariant; call model.eval()")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kv_start, kv_end, q_start = attention_mask[:, :, 0, 0].unbind(0)
    packed = kwargs.get(PACKED_KWARG)
    if packed is None:
        return attend(query, key, value, kv_start, kv_end, q_start, scale, window, sinks), None
    # Packed rows: the bounds are those of the regrouped batch, one sequence per row.
    out = attend(packed.regroup(query), packed.regroup(key), packed.regroup(value), kv_start, kv_end, q_start, scale,
                 window, sinks)
    return packed.ungroup(out), None


def refuse_softcapping(kwargs: dict, surface: str = "model") -> None:
    """Logit softcapping (Gemma 2's ``softcap``) is refused, never dropped."""
    if kwargs.get("softcap") is not None:
        require("softcap_argument", surface)


def encoder_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function of BERT's and XLM-R's self-attention: q [B, H, L, D], k/v [B, H, L, D]
    -> ([B, L, H, D], None), every real query seeing every real key of its row (``attend_bidirectional``).
    ``attention_mask``: the bounds the encoder's pre-hook built (first query past every key)."""
    refuse_softcapping(kwargs)
    if not is_sequence_bounds(attention_mask):
        raise NonInvariantInputError("invariant encoder attention needs the 2-D padding mask (or none); a prepared "
                                     "mask was passed")
    if dropout:
        raise NonInvariantInputError("attention dropout is not batch-invariant; call model.eval()")
    kv_start, kv_end, _ = attention_mask[:, :, 0, 0].unbind(0)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend_bidirectional(query, key, value, kv_start, kv_end, scale), None


def attend(query, key, value, kv_start, kv_end, q_start, scale, window: int = 0, sinks=None, causal: bool = True):
    """The one kernel call of both layouts: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] -> [B, Lq, Hq, D];
    ``sinks`` [Hq]: gpt-oss's attention sinks (``s_aux``). With autograd recording, the autograd
    Function: the same forward bits, plus its backward (``causal=False``: bidirectional self-attention's,
    the forward then run with q_start past every key)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
        return attention_autograd(query, key, value, kv_start, kv_end, q_start, scale, window=window, sinks=sinks,
                                  causal=causal)
    return attention(query, key, value, kv_start, kv_end, q_start, scale, window=window, sinks=sinks)


def attend_bidirectional(query, key, value, kv_start, kv_end, scale, half_window: int | None = None):
    """Self-attention without a causal mask (query i is key i, Lq == Lk) over each row's real keys
    [kv_start, kv_end): all of them (``half_window`` None), or those at most ``half_window`` positions away
    on either side (ModernBERT's local layers). The causal kernel computes both: query i placed past every
    key (q_start = Lk) with no window sees every real key; placed ``half_window`` keys ahead (q_start =
    half_window) with a window of 2 * half_window + 1 keys it sees exactly keys i - half_window ..
    i + half_window. The KV blocks and chunks stay counted from kv_start, so neither the padding nor the
    batch moves a boundary. q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, L, Hq, D]."""
    batch, length = query.shape[0], key.shape[2]
    ahead = length if half_window is None else half_window
    q_start = torch.full((batch,), ahead, dtype=torch.int32, device=query.device)
    window = 0 if half_window is None else 2 * half_window + 1
    # Without a window the backward is the bidirectional one: as causal, every query would sit past the row.
    return attend(query, key, value, kv_start, kv_end, q_start, scale, window, causal=half_window is not None)


def register() -> None:
    """Register both functions; global registration selects nothing until a model asks for it."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, invariant_attention)
    AttentionInterface.register(ENCODER_ATTN_IMPLEMENTATION, encoder_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, invariant_mask)
