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
