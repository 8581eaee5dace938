"""Fixes for Triton's CPU interpreter, so interpreted kernels model the GPU's arithmetic.

The stock interpreter has two defects that matter here:
  * ``tl.dot`` calls ``np.matmul`` on the raw uint16 bits of bf16 blocks, and numpy's
    BLAS does not sum an output element in the same order for every row position (fp8 blocks
    are widened first, but reach the same BLAS call);
  * fp32 -> bf16 casts truncate instead of rounding to nearest even, and fp32 -> fp8 e4m3 casts
    are off by up to a binade (124.4 became 64).

``patched_interpreter()`` swaps in a dot that widens to fp32 (bf16, fp16 and fp8 exactly) and
reduces every output element over k in one sequential order (as one tensor-core instruction does on a GPU,
whatever the other rows hold), and round-to-nearest-even bf16 and fp8 e4m3 casts.

``tl.fma`` on fp32 rounds once, as the GPU's fma does (Triton < 3.7's interpreter multiplied, then
added: two roundings, so a kernel's interpreted bits depended on the Triton release).

It also mends a defect of Triton < 3.7's interpreter: it turns a scalar into a Python int with
``int()`` of its 1-element array, which numpy 2.4 refuses (numpy >= 1.25 warns), so a loop over
computed bounds fails. The fix is installed only where a probe of the stock conversion fails.

While an interpreted launch runs, it also lets nested @triton.jit helpers run interpreted and
turns off the interpreter's integer-overflow sanitizer (costly; our kernels use int64 offsets
where products can pass 2**31). These patches are process-wide for the duration of a CPU
launch: a thread compiling CUDA Triton kernels at that very moment would see them. Single-
threaded use, or CPU and CUDA work in separate processes, is unaffected.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
import warnings

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _interp
from triton.runtime.jit import JITFunction

_lock = threading.RLock()
_depth = 0
_saved: dict = {}
_saved_jit_call: list = [None]
_saved_options: list = [None]
_lang_scope: list = [None]
_saved_patch_lang_tensor: list = [None]


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 (stored as uint16) to fp32 exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def fp32_to_bf16_bits_rne(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16 bits with round-to-nearest-even, NaN kept quiet (as torch/GPUs do)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding_bias = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    rounded = ((bits + rounding_bias) >> np.uint32(16)).astype(np.uint16)
    is_nan = np.isnan(x)
    return np.where(is_nan, np.uint16(0x7FC0), rounded).reshape(np.shape(x))


def _as_fp32(handle) -> np.ndarray:
    dtype = handle.dtype.scalar
    if dtype == tl.bfloat16:
        return bf16_bits_to_fp32(handle.data)
    if dtype.primitive_bitwidth == 8:  # fp8, stored as uint8: widened through fp16, which holds e4m3/e5m2 exactly
        return _interp._convert_float(handle.data, dtype, tl.float16, None).view(np.float16).astype(np.float32)
    return handle.data.astype(np.float32, copy=False)


def sequential_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[M, K] @ [K, N] in fp32, each element summed over k = 0, 1, ..., K-1 in that order: the
    definition. Products are laid out [K, M, N] and reduced over the leading axis, which numpy
    does by adding whole [M, N] slabs one k at a time."""
    products = np.multiply(a.T[:, :, None], b[:, None, :], order="C")  # [K, M, N], whatever a, b's layouts
    return np.add.reduce(products, axis=0)


def _einsum_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # With both operands C-contiguous, numpy's einsum loops k outermost and accumulates into the
    # output: the same sequential order, 5-30x faster than materialising [K, M, N].
    return np.einsum("mk,kn->mn", np.ascontiguousarray(a), np.ascontiguousarray(b), optimize=False)


def _einsum_is_sequential() -> bool:
    """Check, on this numpy, that einsum computes exactly ``sequential_dot`` (shapes as the kernels use)."""
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 64, 64), (32, 256, 256), (7, 33, 5), (64, 16, 128), (16, 512, 16)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        if not np.array_equal(_einsum_dot(a, b), sequential_dot(a, b)):
            return False
    return True


# The fast path only where it provably is the definition; otherwise the definition itself.
fixed_order_dot = _einsum_dot if _einsum_is_sequential() else sequential_dot


def _dot(self, a, b, d, *args, **kwargs):
    if d.dtype.scalar != tl.float32 or not (a.dtype.scalar.is_floating() and b.dtype.scalar.is_floating()):
        return _saved["create_dot"](self, a, b, d, *args, **kwargs)
    a32, b32 = _as_fp32(a), _as_fp32(b)
    if a32.ndim == 3:  # batched: each batch entry as its own product
        product = np.stack([fixed_order_dot(a32[i], b32[i]) for i in range(a32.shape[0])])
    elif a32.ndim == 2:
        product = fixed_order_dot(a32, b32)
    else:
        return _saved["create_dot"](self, a, b, d, *args, **kwargs)
    out = d.data.astype(np.float32) + product
    return _interp.TensorHandle(out.astype(np.float32), tl.float32)


def fma_fp32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """x * y + z of fp32 arrays rounded once to fp32, as a GPU's fma: the product is exact in float64
    (24 + 24 significant bits), the sum is rounded to odd in float64 (an inexact sum whose last bit
    is even moves one ulp toward the exact value, found by TwoSum), and rounding to odd with more
    than two extra bits then rounds to fp32 as the exact value would."""
    x64, y64, z64 = (np.asarray(v, dtype=np.float64) for v in np.broadcast_arrays(x, y, z))
    product = x64 * y64
    total = product + z64
    with np.errstate(invalid="ignore"):  # inf - inf in the error of an infinite sum: not used
        virtual = total - product
        error = (product - (total - virtual)) + (z64 - virtual)
    even = (total.view(np.uint64) & np.uint64(1)) == 0
    nudge = np.isfinite(total) & (error != 0) & even
    toward = np.where(error > 0, np.inf, -np.inf)
    return np.where(nudge, np.nextafter(total, toward), total).astype(np.float32)


def _fma(self, x, y, z):
    if not (x.dtype.scalar == y.dtype.scalar == z.dtype.scalar == tl.float32):
        return _saved["create_fma"](self, x, y, z)
    return _interp.TensorHandle(fma_fp32(x.data, y.data, z.data), tl.float32)


def fp32_to_fp8e4m3_bits(x: np.ndarray) -> np.ndarray:
    """Round fp32 to float8_e4m3fn bits, nearest even, saturating at +-448 (the GPU's
    ``cvt.rn.satfinite``): torch's cast rounds the same way once the range is clamped."""
    clamped = np.clip(np.ascontiguousarray(x, dtype=np.float32), -448.0, 448.0)
    return torch.from_numpy(clamped).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(np.shape(x))


def _round(src, dst_type):
    """The handle for the fixed casts, or None for the stock ones."""
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return _interp.TensorHandle(fp32_to_bf16_bits_rne(src.data), tl.bfloat16)
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
        return _interp.TensorHandle(fp32_to_fp8e4m3_bits(src.data), tl.float8e4nv)
    return None


def _cast(self, src, dst_type):
    fixed = _round(src, dst_type)
    return fixed if fixed is not None else _saved["cast_impl"](self, src, dst_type)


def _fp_to_fp(self, src, dst_type, rounding_mode):
    fixed = _round(src, dst_type)
    return fixed if fixed is not None else _saved["create_fp_to_fp"](self, src, dst_type, rounding_mode)


def _scalar_index(self) -> int:
    return int(self.handle.data.squeeze())  # a 0-d array: what Triton >= 3.7 converts


def _stock_scalar_index_fails() -> bool:
    """Whether this Triton's interpreter fails (or warns) turning a scalar, held as a 1-element array
    as the interpreter holds scalars, into an index."""
    class Probe:
        pass
    _interp._patch_lang_tensor(Probe, _interp._LangPatchScope())
    probe = Probe()
    probe.handle = _interp.TensorHandle(np.array([3], dtype=np.int32), tl.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            return operator.index(probe) != 3
        except (TypeError, DeprecationWarning):
            return True


SCALAR_INDEX_FIX_NEEDED = _stock_scalar_index_fails()


def _patch_lang_tensor_scalar_index(tensor, scope):
    _saved_patch_lang_tensor[0](tensor, scope)
    scope.set_attr(tensor, "__index__", _scalar_index)  # restored with the interpreter's own patches


_PATCHES = {"create_dot": _dot, "cast_impl": _cast, "create_fp_to_fp": _fp_to_fp, "create_fma": _fma}
_twins: dict = {}


def interpreted(fn) -> _interp.InterpretedFunction:
    """The interpreted twin of a @triton.jit function (cached)."""
    fn = getattr(fn, "fn", fn)
    twin = _twins.get(fn)
    if twin is None:
        twin = _twins[fn] = _interp.InterpretedFunction(fn)
    return twin


def _call_jit_as_interpreted(self, *args, **kwargs):
    # Without TRITON_INTERPRET=1, helpers such as tl.sum or tl.cdiv stay JITFunctions;
    # inside an interpreted kernel they must run interpreted too. triton.language.core is
    # patched once per outermost launch (below), not on every call as InterpretedFunction does.
    return interpreted(self).rewrite()(*args, **kwargs)


@contextlib.contextmanager
def patched_interpreter():
    """Apply the fixes for the duration of an interpreted launch (re-entrant)."""
    global _depth
    with _lock:
        if _depth == 0:
            builder = _interp.InterpreterBuilder
            for name, fn in _PATCHES.items():
                _saved[name] = getattr(builder, name)
                setattr(builder, name, fn)
            # create_fp_trunc is bound to cast_impl at class creation; rebind it too.
            _saved["create_fp_trunc"] = builder.create_fp_trunc
            builder.create_fp_trunc = lambda self, src, dst_type: _cast(self, src, dst_type)
            if SCALAR_INDEX_FIX_NEEDED:  # before _patch_lang below, which calls it
                _saved_patch_lang_tensor[0] = _interp._patch_lang_tensor
                _interp._patch_lang_tensor = _patch_lang_tensor_scalar_index
            _saved_jit_call[0] = JITFunction.__call__
            JITFunction.__call__ = _call_jit_as_interpreted
            # The integer-overflow sanitizer costs ~40% of interpreter time; kernels use int64 offsets
            # wherever a product can pass 2**31 instead.
            _lang_scope[0] = _interp._patch_lang(tl.standard.sum.fn)  # patches triton.language.core
            _saved_options[0] = _interp.interpreter_builder.options
            _interp.interpreter_builder.options = dataclasses.replace(_saved_options[0], sanitize_overflow=False)
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                for name, fn in _saved.items():
                    setattr(_interp.InterpreterBuilder, name, fn)
                _saved.clear()
                JITFunction.__call__ = _saved_jit_call[0]
                _interp.interpreter_builder.options = _saved_options[0]
                _lang_scope[0].restore()
                if SCALAR_INDEX_FIX_NEEDED:
                    _interp._patch_lang_tensor = _saved_patch_lang_tensor[0]
