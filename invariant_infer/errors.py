"""Errors raised instead of ever falling back to a batch-variant path."""


class InvariantInferError(Exception):
    """Base of every refusal of this package: ``except InvariantInferError`` catches them all."""


class UnsupportedModelError(InvariantInferError, TypeError):
    """The model (family, layer type, dtype, device or config) cannot be made batch-invariant."""


class NonInvariantInputError(InvariantInferError, ValueError):
    """The inputs would make the result depend on the batch (e.g. an attention mask with holes)."""


class TensorParallelError(InvariantInferError, RuntimeError):
    """A tensor-parallel rank died or failed, so the ranks can no longer run in step; the message
    names the rank. Every rank is stopped: start the ranks again."""


class DeviceError(InvariantInferError, RuntimeError):
    """The accelerator ran out of memory or failed (a CUDA error, a device-side assert). No one
    request is at fault and the device may be unusable, so nothing is retried request by request or
    row by row: the step or batch ends with this error, its cause chained. The message names it."""


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
