"""``audit(model)``: prove, op by op, that a forward's reductions all run on the invariant kernels.

One forward of the model runs under a ``TorchDispatchMode`` that sees every aten op. An op is
*stray* when it can reduce floating-point values in an order the batch may change (a matmul, a
softmax, a float sum, a norm, attention, an all-reduce ...) and it did not run inside one of this
package's kernels (``invariant_infer/kernels/``: the Triton launch and its torch-side preparation).
Everything else is allowed by one of the classes of ``ALLOWED_OP_CLASSES``, each exact in any
order by its own argument; an op in no class is stray too (the audit fails closed: a new op is
refused until it is shown exact or moved onto a kernel).

"Inside a kernel" and "which module" are both read from the Python call stack: "which module" only
when an op is not allowed by its class ("inside a kernel" for every op, to count the ops outside). The op ran inside a kernel when the innermost frame that is not torch's,
Triton's, numpy's or the standard library's own code is in a file of ``invariant_infer/kernels/``:
the launchers' torch-side work counts, and code the kernels call back (a callable passed in) is judged
by its own frames, so no user code path can pass as a kernel; nothing is set, counted or installed
outside an audit. The innermost ``nn.Module._call_impl`` frame names the module: that frame is live
while the module's forward pre-hooks, its forward and its forward hooks run, so an op a hook issues
is charged to the hook's module.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import kernels as _kernels
from ..errors import InvalidArgumentError
from .families import text_config

_KERNELS_DIR = os.path.dirname(os.path.abspath(_kernels.__file__)) + os.sep
# Code between an op and whoever issued it: torch's Python wrappers, Triton's interpreter, numpy, the
# standard library (contextlib, functools; not the packages installed beside it).
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (torch, triton, np))
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_CALL_IMPL = nn.Module._call_impl.__code__


# ---- what is allowed outside a kernel, and why: the one table -------------------------------------
# Each class: which ops (by aten name, and the condition it is checked under) and why they are exact
# whatever the batch holds. ``op_class`` checks them in this order; an op that matches none is stray.

INTEGER = "integer"
ELEMENTWISE = "correctly rounded elementwise"
TWO_VALUES = "reduction of at most two values"
SELECTION = "selection"
DATA_MOVEMENT = "data movement"
COLLECTIVE_MOVEMENT = "collective data movement"
METADATA = "metadata"

ALLOWED_OP_CLASSES: dict[str, str] = {
    INTEGER: "every tensor in and out is integer or bool: integer + and * are associative and commutative (two's "
             "complement wraps modulo 2^n), so a sum, product, cumsum or matmul of integers is the same in any order",
    ELEMENTWISE: "IEEE's correctly rounded operations (+, -, *, /, sqrt, casts, comparisons, min/max, rounding, "
                 "sign): each output element is the one correctly rounded result of the inputs at its position, "
                 "whatever code path (vector body or scalar tail) computes it. Transcendentals (exp, sigmoid, "
                 "tanh, erf, pow ...) are not here: on CPU the vectorized body and the scalar tail approximate them "
                 "differently, so a value's bits can follow its position in the batch; nor are add/sub with an "
                 "alpha other than +-1 (the vector body fuses alpha * b + a into one FMA)",
    TWO_VALUES: "sum, mean, softmax and log_softmax over a dimension of at most two values: max is exact and a sum "
                "of two is one commutative IEEE addition, so no order exists to vary (the softmax's exp is one "
                "code path for every row: the rows are the batch, the vector runs along the two values)",
    SELECTION: "max/min/argmax/argmin/topk/sort/median and kin pick one of the input values (or its index) by "
               "comparison, which never rounds, so any order of comparison selects the same value",
    DATA_MOVEMENT: "views, copies, casts, joins, indexing, non-accumulating scatters and tensor creation move or "
                   "convert each value on its own: no arithmetic between elements",
    COLLECTIVE_MOVEMENT: "all_gather, broadcast and all_to_all copy each rank's values to the others unchanged, and "
                         "wait_tensor waits for them (all_reduce and reduce_scatter add across ranks in an order the "
                         "backend picks: not here)",
    METADATA: "sizes, strides, dtype promotion and assertions: no values computed",
}

_ELEMENTWISE_OPS = frozenset({
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "neg_", "abs", "abs_", "sqrt",
    "sqrt_", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "maximum", "minimum", "fmax",
    "fmin", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "isnan", "isinf", "isfinite", "isneginf",
    "isposinf", "sign", "sgn", "signbit", "copysign", "floor", "ceil", "trunc", "round", "fmod", "remainder",
    "nan_to_num", "relu", "relu_", "heaviside",
})
# add/sub/rsub fold alpha in: exact only when alpha * b is b or -b.
_ALPHA_OPS = frozenset({"add", "add_", "sub", "sub_", "rsub"})

_TWO_VALUE_OPS = frozenset({"sum", "mean", "softmax", "_softmax", "log_softmax", "_log_softmax"})

# Reducing in any order of their values: these give one of the inputs (or its index) and never round.
_SELECTION_OPS = frozenset({
    "max", "min", "amax", "amin", "aminmax", "argmax", "argmin", "topk", "sort", "argsort", "msort", "kthvalue",
    "median", "nanmedian", "mode", "cummax", "cummin", "searchsorted", "bucketize", "_unique", "_unique2",
    "unique_dim", "unique_consecutive", "isin", "equal",
})

# Moving, viewing, casting, selecting or creating values: no arithmetic across elements.
_DATA_MOVEMENT_OPS = frozenset({
    # views and layout
    "view", "_unsafe_view", "reshape", "alias", "as_strided", "expand", "permute", "transpose", "t", "squeeze",
    "unsqueeze", "select", "slice", "narrow", "unbind", "split", "split_with_sizes", "chunk", "unfold", "diagonal",
    "flatten", "unflatten", "movedim", "view_as_real", "view_as_complex", "_reshape_alias", "detach", "lift_fresh",
    # copies, casts and joins
    "clone", "contiguous", "copy_", "_to_copy", "to", "_copy_from", "_copy_from_and_resize", "cat", "stack",
    "flip", "roll", "repeat", "repeat_interleave", "tril", "triu", "pad", "constant_pad_nd", "fill", "fill_",
    "zero_", "set_", "resize_", "_pin_memory", "masked_fill", "masked_fill_", "where",
    # indexing (each output element is one input element, or the value written)
    "index", "_index_put_impl_", "index_put", "index_put_", "index_select", "gather", "take", "masked_select",
    "masked_scatter", "masked_scatter_", "scatter", "scatter_", "embedding", "nonzero", "nonzero_static",
    "slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter", "index_copy", "index_copy_",
    "index_fill", "index_fill_", "narrow_copy",
    # creation
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "arange", "linspace", "scalar_tensor",
    "eye", "tensor", "lift", "_local_scalar_dense",
})
# Writes that accumulate (index_put with accumulate=True, scatter with reduce=...) sum in an order
# the batch can change: data movement only without accumulation.
_ACCUMULATING_ARGUMENTS = {"index_put": "accumulate", "index_put_": "accumulate", "_index_put_impl_": "accumulate",
                           "scatter": "reduce", "scatter_": "reduce"}

# torch.distributed's ops (namespaces c10d and _c10d_functional) that move values between ranks unchanged.
_COLLECTIVE_MOVEMENT_OPS = frozenset({
    "_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
    "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "broadcast",
    "broadcast_", "all_to_all_single", "alltoall_", "alltoall_base_", "wait_tensor", "_wrap_tensor_autograd",
})
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")

_METADATA_OPS = frozenset({
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_nonzero", "is_same_size", "promote_types",
    "result_type", "_has_compatible_shallow_copy_type", "record_stream", "_assert_async", "_assert_scalar",
    "_functional_assert_async", "_assert_tensor_metadata", "sym_constrain_range_for_size",
})


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def op_class(func, args, kwargs, out) -> str | None:
    """The class of ``ALLOWED_OP_CLASSES`` that allows this call outside a kernel, or None (stray)."""
    name = func.overloadpacket.__name__
    collective = func.namespace in _COLLECTIVE_NAMESPACES
    if not collective and func.namespace != "aten":  # another library's op: unknown arithmetic
        return None
    if name in _METADATA_OPS:
        return METADATA
    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    if tensors and not any(_is_float(t) for t in tensors):
        return INTEGER
    if collective:
        return COLLECTIVE_MOVEMENT if name in _COLLECTIVE_MOVEMENT_OPS else None
    if name in _ELEMENTWISE_OPS:
        alpha = _argument(func, args, kwargs, "alpha") if name in _ALPHA_OPS else None
        return ELEMENTWISE if alpha is None or alpha in (1, -1) else None
    if name in _TWO_VALUE_OPS:
        return TWO_VALUES if _reduced_values(func, args, kwargs) <= 2 else None
    if name in _SELECTION_OPS:
        return SELECTION
    if name in _DATA_MOVEMENT_OPS:
        flag = _ACCUMULATING_ARGUMENTS.get(name)
        return None if flag is not None and _argument(func, args, kwargs, flag) else DATA_MOVEMENT
    return None


def _argument(func, args, kwargs, name: str):
    """The value of argument ``name`` of this call (by keyword or position), None when absent."""
    if name in kwargs:
        return kwargs[name]
    for index, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[index] if index < len(args) else None
    return None


def _reduced_values(func, args, kwargs) -> int:
    """How many values each output element of a sum/mean/softmax reduces over."""
    x = args[0]
    dims = _argument(func, args, kwargs, "dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return x.numel()  # all dimensions
    dims = [dims] if isinstance(dims, int) else dims
    count = 1
    for d in dims:
        count *= x.shape[d] if x.dim() else 1
    return count


# ---- the report ---------------------------------------------------------------------------------

@dataclass
class AuditReport:
    """What one audited forward ran. ``stray``: each (module name, op name) whose op reduced floats
    outside an invariant kernel, once per pair, in the order first seen; module names are those
    ``named_modules()`` gives on the audited object ("" is that object itself). ``ok``: none."""
    stray: list[tuple[str, str]] = field(default_factory=list)
    ops_outside_kernels: int = 0      # aten ops issued outside the kernels (allowed or stray)
    ops_in_kernels: int = 0           # aten ops of reducing kind that ran inside the kernels

    @property
    def ok(self) -> bool:
        return not self.stray

    def __str__(self) -> str:
        lines = [f"stray op {op} in {module or '<model>'}" for module, op in self.stray]
        if self.ok:
            lines.append(f"audit ok: every reduction ran on an invariant kernel ({self.ops_outside_kernels} ops "
                         "outside the kernels, each exact in any order)")
        else:
            lines.append(f"audit FAILED: {len(self.stray)} stray op(s) reduce outside the invariant kernels; "
                         "their results can depend on the batch")
        return "\n".join(lines)


class _AuditMode(TorchDispatchMode):
    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names
        self.report = AuditReport()
        self._seen: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if op_class(func, args, kwargs, out) is not None:
            self.report.ops_outside_kernels += _outside_kernels(sys._getframe(1))
            return out
        frame = sys._getframe(1)
        if not _outside_kernels(frame):
            self.report.ops_in_kernels += 1
            return out
        self.report.ops_outside_kernels += 1
        key = (self._module_name(frame), str(func))
        if key not in self._seen:
            self._seen.add(key)
            self.report.stray.append(key)
        return out

    def _module_name(self, frame) -> str:
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                name = self.names.get(id(frame.f_locals.get("self")))
                if name is not None:
                    return name
            frame = frame.f_back
        return "<outside the model>"


def _is_library(filename: str) -> bool:
    if filename.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen"):
        return True
    return filename.startswith(_STDLIB_DIR) and not any(part in filename for part in _INSTALLED)


def _outside_kernels(frame) -> bool:
    """Whether the innermost frame below ``frame`` that is not library code is outside the kernels."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_KERNELS_DIR):
            return False
        if not _is_library(filename):
            return True
        frame = frame.f_back
    return True


# ---- the probe ----------------------------------------------------------------------------------

PROBE_LENGTH = 6   # tokens in the probe's longest row
PROBE_PADDING = 2  # left pads of its second row


def probe_inputs(model: nn.Module) -> dict:
    """Two short rows of token ids, the second left-padded: ``input_ids``, ``attention_mask``,
    ``use_cache=False``. The ids are drawn from a fixed generator, avoiding the config's special
    token ids (an image token with no image would be refused)."""
    config = text_config(getattr(model, "config", None) or _inner_config(model))
    special = {value for source in (getattr(model, "config", None), config) if source is not None
               for key, value in vars(source).items() if key.endswith(("_token_id", "_token_index"))
               and isinstance(value, int)}
    candidates = torch.tensor([i for i in range(min(config.vocab_size, 4096)) if i not in special])
    generator = torch.Generator().manual_seed(0)
    ids = candidates[torch.randint(0, len(candidates), (2, PROBE_LENGTH), generator=generator)]
    mask = torch.ones(2, PROBE_LENGTH, dtype=torch.long)
    mask[1, :PROBE_PADDING] = 0
    device = next(model.parameters()).device
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "use_cache": False}


def _inner_config(model: nn.Module):
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            return module.config
    raise InvalidArgumentError(f"{type(model).__name__} has no config to build a probe from; pass the forward's "
                               "inputs to audit(model, **inputs)")


def audit(model: nn.Module, **inputs) -> AuditReport:
    """Run one forward of ``model`` and report every op that reduced floats outside an invariant kernel.

    ``inputs`` are the forward's keyword arguments (e.g. ``input_ids=..., attention_mask=...,
    pixel_values=..., image_grid_thw=...``); by default ``probe_inputs(model)``, two short token rows,
    one left-padded (a vision tower runs only when the caller passes images). Returns an
    ``AuditReport``: ``.ok``, ``.stray`` (``[(module_name, op_name), ...]``) and a readable ``str``.

    The forward runs under ``torch.no_grad()`` with the RNG state restored afterwards, so the model's
    parameters, buffers and later outputs are untouched. It costs that forward plus a Python call per
    aten op; nothing is installed outside the call. Any ``nn.Module`` can be audited (a stock model
    reports its matmuls, softmaxes and norms). What it proves is where every reduction runs, not that
    rows stay apart: a max over every token of the batch is exact in any order, hence allowed, yet
    depends on the batch (a per-tensor activation scale); ``make_invariant`` refuses or replaces those
    by name and the invariance tests compare rows alone and in batches."""
    inputs = inputs or probe_inputs(model)
    names = {id(module): name for name, module in model.named_modules()}
    devices = [d for d in {t.device for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)} if d.type == "cuda"]
    mode = _AuditMode(names)
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        with mode:
            model(**inputs)
    return mode.report
