"""A backward by recomputation for ops whose invariant kernels have none: the forward's output is
the kernel's, and the backward runs a differentiable torch reference of the same function (in fp32)
on the saved inputs and differentiates it. The bits the forward gives (and so the logprobs a trainer
computes) are the kernels'; the gradients are those of the same function evaluated by torch."""
from __future__ import annotations

from typing import Callable

import torch


class _RecomputedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, reference: Callable, output: torch.Tensor, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
            found = torch.autograd.grad(out, wanted, grad.to(out.dtype), allow_unused=True)
        grads = iter(found)
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))


def recomputed_backward(output: torch.Tensor, reference: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """``output`` (what the kernels computed from ``inputs``), differentiated as ``reference(*inputs)``
    when autograd records any input; as it is otherwise."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return _RecomputedBackward.apply(reference, output, *inputs)
    return output
