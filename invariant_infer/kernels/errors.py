"""The base of every error this package raises, and the kernels' own refusals. They live here, at
the bottom layer, so that the kernels raise them without importing the rest of the package;
``invariant_infer.errors`` re-exports them beside the others."""


class InvariantInferError(Exception):
    """Base of every refusal of this package: ``except InvariantInferError`` catches them all.
    Each subclass also derives from the built-in type callers already catch (ValueError,
    TypeError, RuntimeError, OSError)."""


class InvalidArgumentError(InvariantInferError, ValueError):
    """An argument of the wrong shape, value, device or layout."""


class InvalidDtypeError(InvariantInferError, TypeError):
    """A tensor of a dtype the operation does not take, or tensors whose dtypes differ."""


class UnsupportedOperationError(InvariantInferError, NotImplementedError):
    """An operation this package does not do (a backward pass through an inference-only kernel,
    weight updates under tensor parallelism); the message says what to do instead."""


class KernelLaunchError(InvariantInferError, RuntimeError):
    """A kernel cannot be launched the way its bits are pinned (a Triton build that does not take
    the pinned compile options, CUDA tensors under ``TRITON_INTERPRET=1``)."""
