"""Record the kernel variants a workload launches, as a GPU would compile them, without a GPU.

``recorded_launches()`` makes every ``launch()`` record its kernel variant instead of running
it, and makes CPU tensors take the GPU's tiles (``configs.tile_device``): a CPU run of a model's
forward then yields the variants a CUDA run of it compiles. The offline compile gate
(``offline_compile``) compiles each one for every GPU architecture.

Why record, and why not run: a hand-written list of variants misses the next kernel path; a
recorded one is what the code launches. Launches are not run because the interpreter's cost at
real widths and GPU tiles (small tiles, many programs) is minutes per layer; recorded, a model's
forward at real widths costs its allocations and the few torch ops between kernels. No output is
computed, so a recorded run is for recording only: what is launched never depends on values (every
batch-dependent size is ``do_not_specialize``; tiles follow shapes, dtypes and flags), but code
between the kernels reads some (a router's expert indices). So while recording, ``torch.empty``,
``torch.empty_like`` and ``Tensor.new_empty`` return zeros, a value every consumer takes (top-k
indices all 0 route every token to expert 0), not arbitrary memory; ``paused_recording()`` lifts
all of it for building a model or writing a checkpoint inside a recorded workload.

A variant is what Triton keys its compile on: the kernel, each argument's type (a pointer's dtype,
an int's width), Triton's specialisation of the arguments it specialises (an int equal to 1 becomes
a constant; an int divisible by 16 or a 16-byte-aligned pointer is marked so), the constexpr values,
and the launch options (``num_warps``, ``num_stages``). Triton's own argument binder computes
them, with the CUDA backend's rules, from the very arguments the launch passes.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import create_function_from_signature

from . import configs, launch as launch_mod
from .configs import TileTarget
from .errors import KernelLaunchError

# The target whose specialisation rules the binder applies (the same for every NVIDIA arch).
_BINDING_TARGET = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True)
class KernelVariant:
    """One compiled variant of a kernel: plain data, picklable, comparable across runs."""
    module: str
    name: str
    signature: tuple[tuple[str, str], ...]             # each parameter and its Triton type ("constexpr")
    constexprs: tuple[tuple[tuple[int, ...], object], ...]  # (argument path, value)
    attrs: tuple[tuple[tuple[int, ...], str], ...]     # (argument path, specialisation: "D" divisible by 16)
    options: tuple[tuple[str, object], ...]            # the launch's compile options (num_warps, num_stages)

    @property
    def kernel(self):
        return getattr(importlib.import_module(self.module), self.name)

    def label(self) -> str:
        """The kernel and its constexprs by name, then the launch options: one line per variant."""
        names = [name for name, _ in self.signature]
        consts = [f"{names[path[0]]}={value}" for path, value in self.constexprs
                  if len(path) == 1 and value is not None and names[path[0]] != "DOT_PRECISION"]
        opts = [f"{key}={value}" for key, value in self.options]
        dtypes = sorted({kind for _, kind in self.signature if kind.startswith("*")})
        # the specialised arguments Triton could not mark divisible by 16 (a pointer or int of this launch)
        marked = {path[0] for path, _ in self.attrs}
        specialised = {param.num for param in self.kernel.params if not param.do_not_specialize}
        odd = [name for index, (name, kind) in enumerate(self.signature) if index in specialised
               and index not in marked and (kind.startswith("*") or kind in ("i32", "i64"))]
        odd = f" not16: {','.join(odd)}" if odd else ""
        return f"{self.name}({', '.join(consts)}) [{' '.join(dtypes)}]{odd} {' '.join(opts)}".rstrip()


@dataclass(frozen=True)
class RecordedLaunch:
    """One recorded launch, in launch order: its variant and its grid (programs per axis, 3 axes)."""
    variant: KernelVariant
    grid: tuple[int, int, int]

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def _grid_of(grid, kwargs: dict) -> tuple[int, int, int]:
    """The launch's grid as 3 ints (a callable grid is called with the launch's keyword arguments,
    as Triton calls it with the constexprs)."""
    if callable(grid):
        grid = grid(kwargs)
    sizes = tuple(int(size) for size in grid)
    return (sizes + (1, 1, 1))[:3]


class LaunchRecorder:
    """Called by ``launch()`` in place of a launch: records its variant (and a count per variant)
    and, in ``launches``, each launch's variant and grid in launch order."""

    def __init__(self):
        self.variants: dict[KernelVariant, int] = {}
        self.launches: list[RecordedLaunch] = []
        self._backend = make_backend(_BINDING_TARGET)
        self._binders: dict = {}

    def __call__(self, kernel, device: torch.device, args: tuple, kwargs: dict, grid=(1,)):
        if isinstance(kernel, InterpretedFunction):
            raise KernelLaunchError("recording launches needs compiled kernels: unset TRITON_INTERPRET")
        if device.type != "cpu":
            raise KernelLaunchError(f"recorded launches take CPU tensors (given GPU tiles), got {device.type!r}")
        variant = self.variant_of(kernel, args, kwargs)
        self.variants[variant] = self.variants.get(variant, 0) + 1
        self.launches.append(RecordedLaunch(variant, _grid_of(grid, kwargs)))

    def variant_of(self, kernel, args: tuple, kwargs: dict) -> KernelVariant:
        binder = self._binders.get(kernel)
        if binder is None:
            binder = self._binders[kernel] = create_function_from_signature(kernel.signature, kernel.params,
                                                                            self._backend)
        bound, specialization, options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = kernel._pack_args(self._backend, kwargs, bound, specialization, options)
        types = list(signature.values())
        descs = [spec[1] if types[index] != "constexpr" else "" for index, spec in enumerate(specialization)]
        return KernelVariant(
            module=kernel.fn.__module__, name=kernel.fn.__name__,
            signature=tuple(signature.items()),
            constexprs=tuple(sorted(((path, _plain(value)) for path, value in constexprs.items()), key=str)),
            attrs=tuple((path, descs[path[0]]) for path in sorted(attrs) if len(path) == 1 and descs[path[0]]),
            options=tuple(sorted(options.items())))


def _plain(value):
    """A constexpr's value as plain data (a tl.constexpr global passed on is unwrapped)."""
    return getattr(value, "value", value)


@contextlib.contextmanager
def recorded_launches(target: TileTarget = TileTarget(), zeroed_allocations: bool = True):
    """Within: every launch on CPU tensors is recorded, not run, with ``target``'s tiles. Yields
    the ``LaunchRecorder``, whose ``variants`` and ``launches`` fill as the workload runs. Not re-entrant.
    ``zeroed_allocations=False`` leaves allocations unwritten (so untouched: a large output costs
    address space, not memory), for a caller that reads no value between its launches."""
    if launch_mod._recorder is not None or configs.tile_target() is not None:
        raise KernelLaunchError("recorded_launches is already active")
    recorder = LaunchRecorder()
    configs._tile_target[0] = target
    launch_mod._recorder = recorder
    try:
        with _zeroed_allocations() if zeroed_allocations else contextlib.nullcontext():
            yield recorder
    finally:
        launch_mod._recorder = None
        configs._tile_target[0] = None


@contextlib.contextmanager
def paused_recording():
    """Within ``recorded_launches``: launches run, with their own tiles, and allocations are left
    unwritten again (for building a model or writing a checkpoint inside a recorded workload)."""
    recorder, target, zeroing = launch_mod._recorder, configs._tile_target[0], _zeroing[0]
    launch_mod._recorder, configs._tile_target[0] = None, None
    if zeroing is not None:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = zeroing
    try:
        yield
    finally:
        if zeroing is not None:
            _zero_allocations(zeroing)
        launch_mod._recorder, configs._tile_target[0] = recorder, target


_zeroing: list = [None]  # while recording: the allocators replaced


def _zero_allocations(saved):
    empty, empty_like, new_empty = saved
    torch.empty = lambda *args, **kwargs: empty(*args, **kwargs).zero_()
    torch.empty_like = lambda *args, **kwargs: empty_like(*args, **kwargs).zero_()
    torch.Tensor.new_empty = lambda self, *args, **kwargs: new_empty(self, *args, **kwargs).zero_()


@contextlib.contextmanager
def _zeroed_allocations():
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty
    _zeroing[0] = saved
    _zero_allocations(saved)
    try:
        yield
    finally:
        _zeroing[0] = None
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved

