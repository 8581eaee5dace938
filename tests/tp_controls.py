"""A negative control for the tensor-parallel tests, importable on every rank: the row-parallel
exchange replaced by what stock tensor parallelism does, an all-reduce of each rank's own sum
rounded to the model's dtype, whose order of additions depends on the TP size."""
from __future__ import annotations

import torch.distributed as dist

from invariant_infer.model import tensor_parallel
from invariant_infer.kernels.linear import combine_partials


def allreduce_exchange(parts, bias, dtype, layout):
    """This rank's leaves added, rounded to ``dtype``, then summed across ranks."""
    y = combine_partials(parts.contiguous(), None, dtype)
    dist.all_reduce(y, group=layout.group)
    return y if bias is None else y + bias


def use_allreduce_exchange() -> None:
    """A ``rank_init`` for TensorParallelRanks: every rank exchanges by all-reduce."""
    tensor_parallel.exchange_partials = allreduce_exchange


def fail_on_other_ranks() -> None:
    """A ``rank_init`` that raises on every rank but rank 0 (a rank that cannot start)."""
    import os
    import sys
    if sys.argv[0].endswith(os.path.join("parallel", "worker.py")):
        raise RuntimeError("this rank cannot start")
