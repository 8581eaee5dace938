"""Run one Triton kernel compiled on CUDA tensors, or interpreted (with the harness) on CPU tensors.

Every compiled launch passes ``PINNED_OPTIONS``: the compile options that change arithmetic, set
here rather than left to the installed Triton release's defaults or to environment variables.
  * ``enable_fp_fusion=False``: no mul + add contracted into an FMA by LLVM or ptxas. Triton 3.6
    fuses by default (``TRITON_DEFAULT_FP_FUSION`` unset), 3.9 too (with a warning that 3.10 flips
    it), 3.10 does not; 3.9+ also lets ``TRITON_FORCE_DISABLE_FP_FUSION=1`` override an explicit
    True, never an explicit False. So False is the one value no release and no variable can move.
    It is also what the interpreter computes (numpy rounds every multiply and add on its own).
    ``tl.dot`` on 16-bit inputs is an MMA instruction either way.
  * ``enable_reflect_ftz=True``: libdevice math flushes subnormals, the default of 3.6 and 3.9, kept.
  * ``ptx_options=""``: flags from ``PTXAS_OPTIONS`` (read when Triton is imported) are not passed
    to ptxas, where ``--fmad`` or optimisation flags could change the code.
``tl.dot``'s ``input_precision`` is passed explicitly by every kernel (``DOT_PRECISION``), so
``TRITON_F32_DEFAULT`` and a backend's ``default_dot_input_precision`` never apply. fp8 is not a
supported dtype, so ``max_num_imprecise_acc`` (fp8 dots on sm_90 only) never applies either.

Triton also compiles a variant per argument specialisation: an int that is 1 or divisible by 16,
a pointer aligned to 16 bytes. Batch-dependent sizes (M, rows, query and key lengths, block-table
strides) are ``do_not_specialize`` in every kernel. Alignment picks how many elements a thread
loads at once, and in a row reduction (``tl.sum`` over loaded data) that is the reduction tree:
``reduction_rows`` gives those kernels rows whose alignment depends on the row width alone.
(``tl.dot`` operands are re-laid out for the MMA, so load widths do not reach its arithmetic.)
"""
from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from .interpreter_harness import interpreted, patched_interpreter

PINNED_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": True, "ptx_options": ""}
# The interpreter takes none of these (it drops launch keywords that are not kernel arguments).
_COMPILE_ONLY = ("num_warps", "num_stages", *PINNED_OPTIONS)

# IEEE fp32 products for every dtype: for fp32 inputs this avoids TF32; for bf16/fp16 inputs
# the precision has no effect (an MMA instruction takes them as they are).
DOT_PRECISION = "ieee"


def reduction_rows(x2: torch.Tensor) -> torch.Tensor:
    """``x2`` [M, N] with rows N elements apart from a 16-byte-aligned start: a fresh copy when a
    view has another row stride or start. Then a row kernel's compiled variant, and so its
    summation tree, is fixed by N and the dtype, never by how the caller sliced its batch."""
    if x2.stride(-1) == 1 and x2.stride(0) == x2.shape[1] and x2.data_ptr() % 16 == 0:
        return x2
    return torch.empty(x2.shape, dtype=x2.dtype, device=x2.device).copy_(x2)


def launch(kernel, grid, device: torch.device, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)`` on the device the tensors live on."""
    if device.type == "cuda":
        if isinstance(kernel, InterpretedFunction):
            raise RuntimeError("CUDA tensors with TRITON_INTERPRET=1: unset it to run compiled kernels")
        return kernel[grid](*args, **kwargs, **PINNED_OPTIONS)
    if device.type != "cpu":
        raise ValueError(f"invariant kernels run on 'cuda' or 'cpu' tensors, got {device.type!r}")
    for name in _COMPILE_ONLY:
        kwargs.pop(name, None)
    with patched_interpreter():
        twin = kernel if isinstance(kernel, InterpretedFunction) else interpreted(kernel)
        return twin[grid](*args, **kwargs)
