"""Run one Triton kernel compiled on CUDA tensors, or interpreted (with the harness) on CPU tensors."""
from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from .interpreter_harness import interpreted, patched_interpreter


def launch(kernel, grid, device: torch.device, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)`` on the device the tensors live on."""
    if device.type == "cuda":
        if isinstance(kernel, InterpretedFunction):
            raise RuntimeError("CUDA tensors with TRITON_INTERPRET=1: unset it to run compiled kernels")
        return kernel[grid](*args, **kwargs)
    if device.type != "cpu":
        raise ValueError(f"invariant kernels run on 'cuda' or 'cpu' tensors, got {device.type!r}")
    kwargs.pop("num_warps", None)
    kwargs.pop("num_stages", None)
    with patched_interpreter():
        twin = kernel if isinstance(kernel, InterpretedFunction) else interpreted(kernel)
        return twin[grid](*args, **kwargs)
