"""Which GPUs run the fp8 kernels: Triton has float8_e4m3fn (fp8e4nv) only from compute capability
8.9 (Ada, Hopper); on an Ampere GPU an fp8 kernel would fail to compile at its first launch. The fp8
launchers refuse such a GPU by name instead, before compiling anything.

The capability is read once per device and cached in a plain dict, so a launch reads no device
property (no sync) and a traced (torch.compile) call reads a constant."""
from __future__ import annotations

import torch

from .errors import UnsupportedOperationError

FP8_MIN_CAPABILITY = (8, 9)
# The support table's row (invariant_infer.model.support) says the same, from these two strings.
FP8_LABEL = "FP8 activations on GPUs before compute capability 8.9"
FP8_REASON = ("Triton has no float8_e4m3fn on them (A100, A10, RTX 30xx and older GPUs), so FP8 checkpoints "
              "(compressed-tensors FP8_DYNAMIC, FP8 and FP8_BLOCK, transformers' fp8) run only on a GPU of compute "
              "capability 8.9 or newer (Ada, Hopper); on such a GPU use a W4A16 or W8A16 checkpoint")
FP8_REFUSAL = f"make_invariant does not run {FP8_LABEL}: {FP8_REASON}"

_CAPABILITIES: dict[int, tuple[int, int]] = {}


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, cached per device index; None off CUDA (the interpreter
    and recorded launches run fp8 anywhere)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITIES[index]


def fp8_supported(capability: tuple[int, int]) -> bool:
    return tuple(capability) >= FP8_MIN_CAPABILITY


def check_fp8_device(name: str, device: torch.device) -> None:
    """Refuse an fp8 launch on a GPU without fp8 (compute capability below 8.9)."""
    capability = device_capability(device)
    if capability is not None and not fp8_supported(capability):
        raise UnsupportedOperationError(f"{name} on a GPU of compute capability {capability[0]}.{capability[1]}: "
                                        f"{FP8_REFUSAL}")
