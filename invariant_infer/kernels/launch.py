"""Run one Triton kernel compiled on CUDA tensors, or interpreted (with the harness) on CPU tensors.

Every compiled launch passes ``PINNED_OPTIONS``: the compile options that change arithmetic, set
here rather than left to the installed Triton release's defaults or to environment variables.
  * ``enable_fp_fusion=True``: mul + add pairs outside ``tl.dot`` are contracted into FMAs, as
    Triton 3.6 and 3.9 do by default. That default moves: ``TRITON_DEFAULT_FP_FUSION`` sets it,
    and 3.9 warns that 3.10 turns it off (triton-lang/triton#11270). On, because under ``torch.compile`` (``generate`` with a static
    cache compiles decode on CUDA) inductor compiles these kernels itself with Triton's default
    options, which launch keywords cannot reach: decode must get the bits eager prefill gets, so
    the pin is the default of the releases in use, and ``pinning_problem`` refuses the cases where
    it cannot hold (``TRITON_FORCE_DISABLE_FP_FUSION=1`` overrides an explicit True; a traced
    launch where Triton's default is off).
  * ``enable_reflect_ftz=True``: libdevice math flushes subnormals, the default of 3.6 and 3.9.
  * ``ptx_options=""``: no flags from ``PTXAS_OPTIONS`` (e.g. ``--fmad=false``) reach ptxas.
``tl.dot``'s ``input_precision`` is passed explicitly by every kernel (``DOT_PRECISION``), so
``TRITON_F32_DEFAULT`` and a backend's ``default_dot_input_precision`` never apply. fp8 dots
(``quantized_linear``) sum each K tile from zero and promote it to fp32, so the sm_90 default of
``max_num_imprecise_acc`` sets accuracy within a tile, fixed per weight shape, never by M.

Triton also compiles a variant per argument specialisation: an int that is 1 or divisible by 16,
a pointer aligned to 16 bytes. Batch-dependent sizes (M, rows, query and key lengths, block-table
strides) are ``do_not_specialize`` in every kernel. Alignment picks how many elements a thread
loads at once, and in a row reduction (``tl.sum`` over loaded data) that is the reduction tree:
``reduction_rows`` gives those kernels rows whose alignment depends on the row width alone.
(``tl.dot`` operands are re-laid out for the MMA, so load widths do not reach its arithmetic.)
"""
from __future__ import annotations

import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .interpreter_harness import interpreted, patched_interpreter
from .interpreter_stack import call_on_fresh_chunk
from .errors import InvalidArgumentError, KernelLaunchError

PINNED_OPTIONS = {"enable_fp_fusion": True, "enable_reflect_ftz": True, "ptx_options": ""}
# The interpreter takes none of these (it drops launch keywords that are not kernel arguments).
_COMPILE_ONLY = ("num_warps", "num_stages", *PINNED_OPTIONS)

# IEEE fp32 products for every dtype: for fp32 inputs this avoids TF32; for bf16/fp16 inputs
# the precision has no effect (an MMA instruction takes them as they are).
DOT_PRECISION = "ieee"
# ptxas flags that change the generated code (FMA contraction, optimisation level).
_CODEGEN_PTXAS_FLAGS = ("fmad", "-O", "opt-level", "expensive-optimizations")


def _language_knob(name: str, env: str, default: bool) -> bool:
    language = getattr(getattr(triton, "knobs", None), "language", None)
    if language is not None and hasattr(language, name):
        return bool(getattr(language, name))
    return os.environ.get(env, str(int(default))).lower() in ("1", "true", "on", "yes")


def pinning_problem(traced: bool) -> str | None:
    """Why the pinned options would not hold for a launch (None when they do). ``traced``: under
    torch.compile, where inductor compiles the kernels with Triton's defaults."""
    forced_off = _language_knob("force_disable_fp_fusion", "TRITON_FORCE_DISABLE_FP_FUSION", False)
    if forced_off:
        return ("TRITON_FORCE_DISABLE_FP_FUSION=1 overrides the kernels' pinned enable_fp_fusion=True, which "
                "would change their bits: unset it")
    if not traced:
        return None
    default_on = _language_knob("default_fp_fusion", "TRITON_DEFAULT_FP_FUSION", True)
    ptxas = getattr(getattr(getattr(triton, "knobs", None), "nvidia", None), "ptxas_options", None)
    if not default_on:
        return (f"under torch.compile the kernels compile with Triton {triton.__version__}'s default "
                "enable_fp_fusion=False, not the pinned True, so compiled and eager launches would give other "
                "bits: set TRITON_DEFAULT_FP_FUSION=1")
    if ptxas and any(flag in ptxas for flag in _CODEGEN_PTXAS_FLAGS):
        return (f"under torch.compile PTXAS_OPTIONS={ptxas!r} reaches the kernels' ptxas, which eager launches "
                "never pass: unset it")
    return None


# Triton reads its knobs (and their environment variables) at every compile, so eager launches
# check them at every launch (a few lookups). A traced launch uses the value read at import:
# dynamo would otherwise trace the lookups into the graph.
_TRACED_PROBLEM = pinning_problem(traced=True)


def reduction_rows(x2: torch.Tensor) -> torch.Tensor:
    """``x2`` [M, N] with rows N elements apart from a 16-byte-aligned start: a fresh copy when a
    view has another row stride or start. Then a row kernel's compiled variant, and so its
    summation tree, is fixed by N and the dtype, never by how the caller sliced its batch."""
    # No data pointer while tracing: there inductor aligns misaligned inputs and works out a
    # view's alignment from its offset, as the eager launch does from the pointer.
    aligned = torch.compiler.is_compiling() or x2.data_ptr() % 16 == 0
    if aligned and x2.stride(-1) == 1 and x2.stride(0) == x2.shape[1]:
        return x2
    return torch.empty(x2.shape, dtype=x2.dtype, device=x2.device).copy_(x2)


# While ``launch_recording.recorded_launches`` runs: a callable that records each launch instead
# of running it. One test of it per launch otherwise.
_recorder = None


def launch(kernel, grid, device: torch.device, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)`` on the device the tensors live on."""
    if _recorder is not None:
        return _recorder(kernel, device, args, kwargs, grid)
    if device.type == "cuda":
        if isinstance(kernel, InterpretedFunction):
            raise KernelLaunchError("CUDA tensors with TRITON_INTERPRET=1: unset it to run compiled kernels")
        if torch.compiler.is_compiling():  # inductor compiles the kernel: options cannot be passed
            if _TRACED_PROBLEM:
                raise KernelLaunchError(_TRACED_PROBLEM)
            return kernel[grid](*args, **kwargs)
        problem = pinning_problem(traced=False)
        if problem:
            raise KernelLaunchError(problem)
        return kernel[grid](*args, **kwargs, **PINNED_OPTIONS)
    if device.type != "cpu":
        raise InvalidArgumentError(f"invariant kernels run on 'cuda' or 'cpu' tensors, got {device.type!r}")
    for name in _COMPILE_ONLY:
        kwargs.pop(name, None)
    with patched_interpreter():
        twin = kernel if isinstance(kernel, InterpretedFunction) else interpreted(kernel)
        return call_on_fresh_chunk(twin[grid], args, kwargs)  # no frame-chunk mapping per call
