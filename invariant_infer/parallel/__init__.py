"""One process per tensor-parallel rank: ``TensorParallelRanks`` starts, drives and stops them."""
from .ranks import TensorParallelRanks

__all__ = ["TensorParallelRanks"]
