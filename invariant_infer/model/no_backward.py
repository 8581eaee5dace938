"""Ops that have an invariant forward but no backward yet: their output, as computed, carries a backward
that raises, so a gradient never silently skips them (a plain forward with autograd on still runs)."""
from __future__ import annotations

import torch

from ..errors import UnsupportedModelError


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, what: str, output: torch.Tensor, *inputs):
        ctx.what = what
        return output.view_as(output)

    @staticmethod
    def backward(ctx, *grads):
        raise UnsupportedModelError(f"training through {ctx.what} is not supported yet: its kernels have no backward")


def without_backward(output: torch.Tensor, inputs, what: str) -> torch.Tensor:
    """``output``, tied to ``inputs`` by a backward that raises when autograd records any of them."""
    inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _NoBackward.apply(what, output, *inputs)
    return output
