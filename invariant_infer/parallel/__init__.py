"""One process per tensor-parallel rank: ``TensorParallelRanks`` (``supervisor``) starts, drives
and stops them; ``worker`` is the other ranks' process, ``loading`` how every rank loads its shard,
``forced_exit`` how a command ends when a rank's failure leaves a collective stuck."""
from __future__ import annotations

__all__ = ["TensorParallelRanks"]


def __getattr__(name: str):
    # Imported on first use: ``python -m invariant_infer.parallel.worker`` imports this package
    # first, and must not find its own module imported already (by the supervisor's import).
    if name == "TensorParallelRanks":
        from .supervisor import TensorParallelRanks
        return TensorParallelRanks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
