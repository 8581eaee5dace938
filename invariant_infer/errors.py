"""Every error class of this package, one hierarchy: each derives from ``InvariantInferError``
and from the built-in type callers already catch. Nothing falls back to a batch-variant path: what
cannot be run invariantly is refused with one of these."""
from .kernels.errors import (InvalidArgumentError, InvalidDtypeError, InvariantInferError, KernelLaunchError,
                             UnsupportedOperationError)

__all__ = [
    "InvariantInferError", "InvalidArgumentError", "InvalidDtypeError", "UnsupportedOperationError",
    "KernelLaunchError", "UnsupportedModelError", "NonInvariantOpError", "NonInvariantInputError",
    "TensorParallelError", "DeviceError", "RequestError", "RequestFailedError", "EngineBusyError", "LoraAdapterError",
    "SpeculativeConfigError", "ScoringRequestError", "JobError", "CheckpointError", "CheckpointLoadError",
    "UnsupportedTRLError", "InternalError",
]


class UnsupportedModelError(InvariantInferError, TypeError):
    """The model (family, layer type, dtype, device or config) cannot be made batch-invariant."""


class NonInvariantOpError(UnsupportedModelError):
    """The patched forward runs an op that reduces floats outside the invariant kernels (found by
    ``audit``; raised by ``make_invariant(model, strict=True)``, which leaves the model unpatched).
    ``stray``: the (module name, op name) pairs, which the message names."""

    def __init__(self, message: str, stray: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.stray = list(stray or [])


class NonInvariantInputError(InvariantInferError, ValueError):
    """The inputs would make the result depend on the batch (e.g. an attention mask with holes)."""


class TensorParallelError(InvariantInferError, RuntimeError):
    """A tensor-parallel rank died or failed, so the ranks can no longer run in step; the message
    names the rank. Every rank is stopped: start the ranks again."""


class DeviceError(InvariantInferError, RuntimeError):
    """The accelerator ran out of memory or failed (a CUDA error, a device-side assert). No one
    request is at fault and the device may be unusable, so nothing is retried request by request or
    row by row: the step or batch ends with this error, its cause chained. The message names it."""


class RequestError(InvariantInferError, ValueError):
    """A request the engine refuses at admission (its other requests keep running). ``param`` names
    the offending field (a ``SamplingParams`` field, or "prompt"), None when no one field is at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailedError(InvariantInferError, RuntimeError):
    """A request (or a rollout) that the engine admitted ended with an error; the message names it."""


class EngineBusyError(InvariantInferError, RuntimeError):
    """The engine has unfinished requests (or KV pages in use), and the operation needs an idle engine."""


class LoraAdapterError(InvariantInferError, ValueError):
    """An adapter that cannot be loaded or removed (bad shapes, rank, target; unknown; in use)."""


class SpeculativeConfigError(InvariantInferError, ValueError):
    """A speculative-decoding configuration, or a draft model, that the engine refuses."""


class ScoringRequestError(InvariantInferError, ValueError):
    """A scoring request that cannot be turned into token ids; the message says why."""


class JobError(InvariantInferError, RuntimeError):
    """A fatal problem of a scoring job: it cannot start or cannot go on. Rows already written stay.
    ``rank_failed``: a tensor-parallel rank failed (a re-run resumes)."""

    def __init__(self, message: str, *, rank_failed: bool = False):
        super().__init__(message)
        self.rank_failed = rank_failed


class CheckpointError(InvariantInferError, ValueError):
    """A checkpoint that cannot replace the model's weights; the message names the problem. Raised
    before anything is copied: the model keeps its weights."""


class CheckpointLoadError(InvariantInferError, OSError):
    """A checkpoint folder without what loading it needs (a config, a tokenizer)."""


class UnsupportedTRLError(InvariantInferError, ValueError):
    """A TRL version or a GRPOConfig option the integration does not support."""


class InternalError(InvariantInferError, RuntimeError):
    """A check of this package's own consistency failed: a bug, not the caller's input."""


# Messages of the plain RuntimeErrors a failed device raises (torch before AcceleratorError, cuBLAS,
# Triton's launcher).
DEVICE_ERROR_MARKERS = ("CUDA error", "device-side assert", "CUBLAS_STATUS_", "CUDNN_STATUS_",
                        "illegal memory access")


def device_failure(exc: BaseException) -> str | None:
    """"out of memory" or "device error" if ``exc`` is one (see ``DeviceError``), else None."""
    import torch

    out_of_memory = (torch.cuda.OutOfMemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
    if isinstance(exc, out_of_memory) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc)):
        return "out of memory"
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return "device error"
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in DEVICE_ERROR_MARKERS):
        return "device error"
    return None


def raise_if_device_failure(exc: BaseException, where: str) -> None:
    """Raise ``DeviceError`` from ``exc`` if it is a device failure; return otherwise."""
    kind = device_failure(exc)
    if kind is not None:
        raise DeviceError(f"the device failed ({kind}) in {where}: {type(exc).__name__}: {exc}. A device failure "
                          "is no one request's fault, so nothing was retried request by request") from exc
