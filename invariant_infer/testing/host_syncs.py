"""Counting host syncs: the tensor calls that read values back into Python.

On a GPU each of them waits for the device (``tolist``, ``item``, ``bool(t)``, a boolean-mask
index, whose output size depends on values, ...), so a step that makes them cannot run ahead of
the device nor be captured in a CUDA graph. On CPU nothing waits, but the same calls are made, so
counting them on CPU counts the syncs the same code makes on a GPU.

    with count_host_syncs(inside=base_model(model)) as syncs:
        model(input_ids, attention_mask=mask)
    assert syncs.count == 0, syncs.summary()

``inside``: count only while that module's forward runs (its first forward pre-hook starts, its
forward hook stops), so the checks a call makes at its entry point, outside the decoder, are not
counted. Each sync records where it came from (the innermost frames in the project, transformers
or PEFT), so a failing test names the culprit. Calls made by Triton's interpreter, which runs the
kernels on CPU and reads their arguments as arrays, are not counted: a compiled launch reads none.

A ``TorchFunctionMode`` sees every Tensor method and torch function it counts (torch 2.11 and
2.13), including the dunders ``if t:``, ``int(t)``, ``range(t)`` and f-strings call; the mode is
off while it handles a call, so a call that makes others inside it counts once.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Calls that always read values (or their number) into Python.
_ALWAYS = frozenset({
    "tolist", "item", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__complex__",
    "__index__", "__format__", "__repr__", "__contains__", "nonzero", "argwhere", "unique",
    "unique_consecutive", "masked_select", "equal", "allclose", "bincount",
})
_TRITON_DIR = os.path.dirname(os.path.abspath(__import__("triton").__file__)) + os.sep
_HARNESS = os.path.join("invariant_infer", "kernels", "interpreter_harness.py")
_REPORTED = (os.sep + "invariant_infer" + os.sep, os.sep + "transformers" + os.sep, os.sep + "peft" + os.sep,
             os.sep + "tests" + os.sep)


@dataclass(frozen=True)
class HostSync:
    """One counted call: its name and the frames that made it, innermost first ("file:line")."""
    call: str
    where: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.call} at {' <- '.join(self.where) or '<outside the project>'}"


@dataclass
class HostSyncs:
    """The syncs counted in one ``count_host_syncs`` block."""
    events: list[HostSync] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.events)

    def summary(self, limit: int = 20) -> str:
        """The distinct syncs, most frequent first, each with its count."""
        counts = Counter(str(event) for event in self.events)
        lines = [f"{n} x {sync}" for sync, n in counts.most_common(limit)]
        return f"{self.count} host syncs" + ("".join(f"\n  {line}" for line in lines) if lines else "")


def _is_bool_index(index) -> bool:
    if isinstance(index, tuple):
        return any(_is_bool_index(part) for part in index)
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) and index.dim() > 0


def _moves_to_host(args, kwargs) -> bool:
    """``t.to(...)`` from a device tensor to the CPU."""
    tensor = args[0] if args else None
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "cpu":
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


def reads_values(name: str, args, kwargs) -> bool:
    """Whether a call named ``name`` (a torch function or Tensor method) with these arguments reads
    tensor values into Python, i.e. syncs with the device."""
    if name in _ALWAYS:
        return True
    if name == "repeat_interleave":  # the output size is the repeats' sum, unless given
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "where":  # torch.where(condition): nonzero
        return len(args) + len(kwargs) == 1
    if name == "__getitem__":
        return _is_bool_index(args[1])
    if name == "__setitem__":  # a boolean mask with one value is masked_fill; with many, index_put
        value = args[2]
        return _is_bool_index(args[1]) and isinstance(value, torch.Tensor) and value.numel() > 1
    if name == "to":
        return _moves_to_host(args, kwargs)
    return False


def _caller_frames(depth: int = 4) -> tuple[str, ...] | None:
    """The innermost ``depth`` reported frames ("file:line"); None when Triton's interpreter made the call."""
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_TRITON_DIR) or filename.endswith(_HARNESS):
            return None
        if filename == __file__:  # a counting mode nested in another hands the call on
            frame = frame.f_back
            continue
        if len(frames) < depth and any(part in filename for part in _REPORTED):
            frames.append(f"{_short(filename)}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(frames)


def _short(filename: str) -> str:
    for root in ("invariant_infer", "transformers", "peft", "tests"):
        marker = os.sep + root + os.sep
        if marker in filename:
            return root + os.sep + filename.rsplit(marker, 1)[1]
    return filename


class _CountingMode(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs, self.depth, self.scoped = syncs, 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth or not self.scoped:
            name = getattr(func, "__name__", "")
            if reads_values(name, args, kwargs):
                where = _caller_frames()
                if where is not None:
                    self.syncs.events.append(HostSync(name, where))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs(inside: nn.Module | None = None):
    """Count host syncs made in the block (see the module's docstring); yields a ``HostSyncs``.
    ``inside``: count only while that module's forward (its hooks included) runs."""
    syncs = HostSyncs()
    mode = _CountingMode(syncs)
    handles = []
    if inside is not None:
        mode.scoped = True

        def start(module, args):
            mode.depth += 1

        def stop(module, args, output):
            mode.depth -= 1
        handles = [inside.register_forward_pre_hook(start, prepend=True),
                   inside.register_forward_hook(stop, always_call=True)]
    try:
        with mode:
            yield syncs
    finally:
        for handle in handles:
            handle.remove()
