"""Pooled outputs of token states, each row on its own: ``pool(hidden, attention_mask, mode)`` and
``normalize(x)``.

The modes are sentence-transformers' names. "mean", "weightedmean" and "mean_sqrt_len_tokens" sum a
row's real tokens on the pooling kernel (``kernels.pooling``: fp32, blocks counted from the row's first
real token); "cls" and "lasttoken" take the row's first and last real token, and "max" the largest
value over its real tokens, which are exact whatever the order. A row's real tokens are the ones of
its mask, one contiguous run on either padding side; a mask with holes is refused, a row without real
tokens pools to zeros. The outputs carry no gradient: with autograd recording, a backward through
them raises.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError, NonInvariantInputError
from ..kernels import l2_normalize, pool_tokens
from .no_backward import without_backward
from .padding import mask_holes

POOLING_MODES = ("cls", "lasttoken", "max", "mean", "mean_sqrt_len_tokens", "weightedmean")
_SUMMED = {"mean": (False, "count"), "mean_sqrt_len_tokens": (False, "sqrt_count"),
           "weightedmean": (True, "weight_sum")}


def token_bounds(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) int64 [B]: each row's real tokens are ``start .. end - 1``; (0, 0) for a row
    without any. Refuses a mask with holes (one host read)."""
    if attention_mask.dim() != 2:
        raise InvalidArgumentError(f"pooling takes a 2-D attention_mask [batch, tokens], got "
                                   f"{tuple(attention_mask.shape)}")
    holes = mask_holes(attention_mask)
    if bool(holes.any()):
        rows = holes.nonzero().flatten().tolist()
        raise NonInvariantInputError(f"pooling: attention_mask rows {rows[:8]} have holes (their ones are not "
                                     "contiguous); a row's real tokens must be one run, padded on either side")
    mask = attention_mask.to(torch.int32)
    count = mask.sum(-1)
    start = torch.where(count > 0, mask.argmax(-1), 0)
    return start, start + count


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """[B, H] pooled rows of ``hidden`` [B, L, H] over each row's real tokens (``attention_mask``
    [B, L]; None: every token is real), in ``hidden``'s dtype."""
    if mode not in POOLING_MODES:
        raise InvalidArgumentError(f"pooling mode {mode!r} is not one of {POOLING_MODES}")
    if hidden.dim() != 3:
        raise InvalidArgumentError(f"pool: hidden must be [batch, tokens, hidden], got {tuple(hidden.shape)}")
    b, l, _ = hidden.shape
    if attention_mask is None:
        attention_mask = torch.ones((b, l), dtype=torch.int64, device=hidden.device)
    if attention_mask.shape != (b, l):
        raise InvalidArgumentError(f"pool: attention_mask {tuple(attention_mask.shape)} does not match hidden "
                                   f"{tuple(hidden.shape)}")
    attention_mask = attention_mask.to(hidden.device)
    start, end = token_bounds(attention_mask)
    with torch.no_grad():
        pooled = _pool(hidden, attention_mask, start, end, mode)
    return without_backward(pooled, [hidden], f"{mode} pooling")


def _pool(hidden, attention_mask, start, end, mode):
    if mode in _SUMMED:
        weighted, divisor = _SUMMED[mode]
        return pool_tokens(hidden, start, end, weighted, divisor)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    real = (end > start)[:, None]
    if mode == "cls":
        return torch.where(real, hidden[rows, start.clamp(max=hidden.shape[1] - 1)], 0)
    if mode == "lasttoken":
        return torch.where(real, hidden[rows, (end - 1).clamp(min=0)], 0)
    masked = hidden.masked_fill(attention_mask[..., None] == 0, float("-inf"))  # "max": exact in any order
    return torch.where(real, masked.max(dim=1).values, 0)


def normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """x / max(||x||_2, eps) over the last dim, each row on its own, in x's dtype (as
    ``torch.nn.functional.normalize``)."""
    with torch.no_grad():
        y = l2_normalize(x, eps)
    return without_backward(y, [x], "L2 normalisation")
