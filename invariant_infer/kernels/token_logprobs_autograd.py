"""Token logprobs with a backward: the forward is ``token_logprobs``' kernel, the backward one Triton kernel.

With x = logits.float() / T and lse the row's log-sum-exp (stored by the forward launch, whose
reduction over the vocabulary it is), logprob[r] = x[r, target[r]] - lse[r], so

    d logits[r, v] = g[r] / T * (onehot(target[r])[v] - exp(x[r, v] - lse[r])),

rounded once to the logits' dtype. Each element needs only its own row's lse: no reduction in the
backward, so a row's gradient never depends on the other rows, and g[r] = 0 gives a zero row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .configs import tile_device
from .token_logprobs import launch_token_logprobs, vocab_block


@triton.jit(do_not_specialize=["R"])
def _token_logprobs_backward_kernel(logits_ptr, targets_ptr, lse_ptr, grad_ptr, dlogits_ptr, R, V, stride_r,
                                    temperature, BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    rows = tl.minimum(rows, R - 1)  # tail rows re-read the last row (never stored)
    cols = tl.arange(0, BLOCK_V)
    targets = tl.load(targets_ptr + rows)
    lse = tl.load(lse_ptr + rows)
    scale = tl.math.div_rn(tl.load(grad_ptr + rows), temperature)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        mask = row_ok[:, None] & (idx[None, :] < V)
        offsets = rows[:, None] * stride_r + idx[None, :]
        x = tl.math.div_rn(tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32), temperature)
        onehot = tl.where(idx[None, :] == targets[:, None], 1.0, 0.0)
        d = scale[:, None] * (onehot - tl.exp(x - lse[:, None]))
        tl.store(dlogits_ptr + offsets, d.to(dlogits_ptr.dtype.element_ty), mask=mask)


def token_logprobs_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                            temperature: float, block_v: int | None = None) -> torch.Tensor:
    """d logits [R, V] (the logits' dtype) for the gradient ``grad`` [R] of the logprobs. ``logits``
    are the contiguous rows the forward reduced, ``lse`` its stored log-sum-exp."""
    r, v = logits.shape
    dlogits = torch.empty_like(logits)
    if r == 0:
        return dlogits
    grad = grad.to(device=logits.device, dtype=torch.float32).contiguous()
    block_rows = 16 if tile_device(logits.device.type) == "cpu" else 1
    block_v = block_v or vocab_block(logits.device.type, v)
    launch(_token_logprobs_backward_kernel, (triton.cdiv(r, block_rows),), logits.device,
           logits, targets, lse, grad, dlogits, r, v, logits.stride(0), temperature,
           BLOCK_ROWS=block_rows, BLOCK_V=block_v, num_warps=4 if block_v <= 1024 else 8)
    return dlogits


class TokenLogprobsFunction(torch.autograd.Function):
    """``token_logprobs``' logprob (bitwise the kernel's) with a row-local backward to the logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                block_v: int | None = None) -> torch.Tensor:
        logprobs, _, lse, rows, targets = launch_token_logprobs(logits, targets, temperature, store_lse=True,
                                                                block_v=block_v)
        ctx.save_for_backward(rows, targets, lse)
        ctx.temperature, ctx.block_v, ctx.shape = float(temperature), block_v, logits.shape
        return logprobs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, targets, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        dlogits = token_logprobs_backward(rows, targets, lse, grad, ctx.temperature, ctx.block_v)
        return dlogits.reshape(ctx.shape), None, None, None


def token_logprobs_autograd(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                            block_v: int | None = None) -> torch.Tensor:
    """Differentiable fp32 [R] log_softmax(logits / temperature)[r, targets[r]] for logits [R, V]:
    the same bits as ``token_logprobs``, and a d logits whose row r depends on row r alone.
    ``block_v`` replaces the vocabulary block width (tests only)."""
    return TokenLogprobsFunction.apply(logits, targets, temperature, block_v)
