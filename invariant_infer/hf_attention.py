"""The attention and mask functions registered with transformers under the name ``invariant``.

The mask function does not build a [B, 1, Lq, Lk] mask: it reduces the 2-D padding mask to
per-row bounds (first real key, end of real keys, position of the first query), which is
all the kernel needs to align its KV blocks to each row's first real token.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from .errors import NonInvariantInputError
from .kernels import attention

ATTN_IMPLEMENTATION = "invariant"


def sequence_bounds(attention_mask: torch.Tensor | None, batch_size: int, kv_length: int,
                    q_offset, device) -> torch.Tensor:
    """int32 [3, B] with rows kv_start, kv_end, q_start, from a 2-D padding mask whose ones are contiguous.

    Traceable (no host sync): the contiguity check lives in the model's pre-forward hook."""
    if attention_mask is None:
        kv_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
        kv_end = torch.full((batch_size,), kv_length, dtype=torch.int32, device=device)
    else:
        mask = attention_mask[:, -kv_length:].to(device=device, dtype=torch.int32)
        kv_start = mask.argmax(dim=1).to(torch.int32)  # first real key (0 for an empty row)
        kv_end = kv_start + mask.sum(dim=1, dtype=torch.int32)
    if isinstance(q_offset, torch.Tensor):
        q_start = q_offset.to(device=device, dtype=torch.int32).reshape(-1)[:1].expand(batch_size)
    else:
        q_start = torch.full((batch_size,), int(q_offset), dtype=torch.int32, device=device)
    return torch.stack([kv_start, kv_end, q_start])


def invariant_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                   mask_function=causal_mask_function, attention_mask=None, device=None, **kwargs):
    """Mask builder for transformers' ``create_causal_mask``; returns ``sequence_bounds``."""
    if mask_function is not causal_mask_function:
        raise NonInvariantInputError(
            "invariant attention supports plain causal masks with 2-D padding only; packed sequences "
            "(position_ids that restart inside a row without an attention_mask) and custom mask functions "
            "are not supported. Pass an attention_mask, one sequence per row.")
    if isinstance(kv_offset, int) and kv_offset != 0:
        raise NonInvariantInputError("invariant attention does not support sliding-window KV offsets")
    if device is None:
        device = attention_mask.device if attention_mask is not None else torch.device("cpu")
    return sequence_bounds(attention_mask, batch_size, kv_length, q_offset, device)


def invariant_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """transformers attention function: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] -> ([B, Lq, Hq, D], None)."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[0] != 3:
        raise NonInvariantInputError(
            "invariant attention needs the 2-D padding mask (or none); a prepared 4-D mask or a paged cache "
            f"was passed (got {None if attention_mask is None else tuple(attention_mask.shape)}).")
    if dropout:
        raise NonInvariantInputError("attention dropout is not batch-invariant; call model.eval()")
    if sliding_window is not None:
        raise NonInvariantInputError("sliding-window attention is not supported by invariant attention")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kv_start, kv_end, q_start = attention_mask.unbind(0)
    return attention(query, key, value, kv_start, kv_end, q_start, scale), None


def register() -> None:
    """Register both functions; global registration selects nothing until a model asks for it."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, invariant_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, invariant_mask)
