"""Negative controls for the tensor-parallel tests, importable on every rank: the row-parallel
exchange replaced by what stock tensor parallelism does, an all-reduce of each rank's own sum
rounded to the model's dtype, whose order of additions depends on the TP size; row-parallel
adapter slots that shrink each rank's K shard and all-reduce the sums, as stock LoRA under TP does;
and projections whose BLOCK_K depends on M, on every rank."""
from __future__ import annotations

import torch.distributed as dist

from invariant_infer.model import lora, tensor_parallel
from invariant_infer.kernels.linear import combine_partials, linear


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
def sharded_lora_shrink_apply(self, out, x):
    """Stock row-parallel LoRA: each rank shrinks its own K shard with its columns of A, and the
    ranks all-reduce the [M, r] sums (an order of additions that depends on the TP size)."""
    groups = self.step_groups()
    if self.layout is None or self.columns_sharded or not groups:
        return ORIGINAL_LORA_APPLY(self, out, x)
    x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
    for slot, rows in groups:
        rank = self.ranks[slot]
        if rank:
            a = self.a[slot, :rank].chunk(self.layout.size, dim=1)[self.layout.rank].contiguous()
            shrunk = linear(x2[rows].to(a.dtype), a)
            dist.all_reduce(shrunk, group=self.layout.group)
            delta = out2[rows] + linear(shrunk, self.b[slot, :, :rank]) * self.scalings[slot]
            out2.index_copy_(0, rows, delta.to(out2.dtype))
    return out


ORIGINAL_LORA_APPLY = lora.SlotWeights.apply


def use_sharded_lora_shrink() -> None:
    """A ``rank_init`` for TensorParallelRanks: row-parallel adapter slots shrink K shards and all-reduce."""
    lora.SlotWeights.apply = sharded_lora_shrink_apply


def use_m_dependent_linear() -> None:
    """A ``rank_init`` for TensorParallelRanks: every rank's projections pick BLOCK_K by M (the
    GEMM control of ``helpers.controls``), both the single-process forwards and the column-parallel ones."""
    from helpers.controls import m_dependent_linear
    from invariant_infer.model import layer_forwards
    layer_forwards.linear = m_dependent_linear
    tensor_parallel.linear = m_dependent_linear
