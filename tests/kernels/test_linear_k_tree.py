"""The K tree of linear's configs, exactly: one continuous K loop gives the chunk-by-chunk definition's
bits on either schedule, and the GPU rule's trees are batch-invariant while a split-K picked by M is not."""
import pytest
import torch
import triton

from invariant_infer.kernels import LinearConfig, linear, linear_config
from invariant_infer.kernels.linear_configs import chunk_length


def _step_sum(x, w):
    """The interpreter harness's dot of one BLOCK_K step: each element's products summed in k order."""
    products = x.T[:, :, None] * w.T[:, None, :]  # [k, M, N] fp32 products
    total = products[0]
    for p in products[1:]:
        total = total + p
    return total


def chunk_tree_reference(x, w, cfg):
    """y = x @ w^T by the definition of ``cfg``'s tree: each chunk summed from zero in BLOCK_K steps
    (a step's products in k order, as one MMA instruction), the chunk sums added in chunk order."""
    k = x.shape[1]
    chunk = chunk_length(cfg, k)
    total = torch.zeros(x.shape[0], w.shape[0])
    for c in range(cfg.k_chunks):
        part = torch.zeros_like(total)
        for k0 in range(c * chunk, min(k, (c + 1) * chunk), cfg.block_k):
            k1 = min(k0 + cfg.block_k, (c + 1) * chunk, k)
            part = part + _step_sum(x[:, k0:k1], w[:, k0:k1])
        total = total + part
    return total


TREES = [LinearConfig(16, 16, 32, k_chunks=3),               # 7 steps: chunks of 3, 3 and 1
         LinearConfig(16, 16, 32, k_chunks=4, chunk_k=48),   # chunks of 1.5 steps: each last step masked
         LinearConfig(16, 16, 16, k_chunks=5)]               # chunks of 3 steps, the last one 1 (K = 200)


@pytest.mark.parametrize("cfg", TREES, ids=["tail-chunk", "masked-steps", "short-last"])
def test_continuous_loop_is_the_chunk_by_chunk_tree(cfg):
    """fp32 inputs, so every product and sum is visible: the kernel's one loop with a flush at each
    chunk's end equals the definition bit for bit, on the sequential and the parallel schedule."""
    g = torch.Generator().manual_seed(0)
    k = 192 if cfg.chunk_k else 200
    x, w = torch.randn(5, k, generator=g), torch.randn(24, k, generator=g)
    reference = chunk_tree_reference(x, w, cfg)
    for parallel in (False, True):
        assert torch.equal(linear(x, w, config=cfg, parallel_chunks=parallel), reference), parallel
    # control: the reference tells trees apart (one chunk of all of K is another sum)
    assert not torch.equal(chunk_tree_reference(x, w, LinearConfig(16, 16, cfg.block_k)), reference)


def _m_dependent_split_k(x, w, cfg):
    """Negative control: split-K only at small M, as batch-size-keyed split-K heuristics do."""
    return linear(x, w, config=cfg if x.shape[0] <= 4 else LinearConfig(cfg.block_m, cfg.block_n, cfg.block_k))


def test_gpu_rule_tree_is_batch_invariant_and_split_k_by_m_is_not():
    """Qwen3-8B's k/v projection (N = 1024, K = 4096: 32 chunks of 128) on two of its N tiles, fp32:
    a row alone on the parallel schedule (a GPU's small-M choice) equals the row in a batch of 100
    (two row tiles) on the sequential one; picking split-K by M changes rows."""
    cfg = linear_config("cuda", torch.bfloat16, 1024, 4096)
    assert cfg.k_chunks == 32 and cfg.block_m == 128
    cfg = LinearConfig(64, cfg.block_n, cfg.block_k, k_chunks=cfg.k_chunks, chunk_k=cfg.chunk_k)  # fewer idle rows
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2 * cfg.block_n, 4096, generator=g) / 64
    x = torch.randn(100, 4096, generator=g)
    batch = linear(x, w, config=cfg, parallel_chunks=False)
    for i in (0, 77, 99):
        assert torch.equal(linear(x[i:i + 1], w, config=cfg, parallel_chunks=True)[0], batch[i])
    control = _m_dependent_split_k(x, w, cfg)
    assert not all(torch.equal(_m_dependent_split_k(x[i:i + 1], w, cfg)[0], control[i]) for i in (0, 77, 99))
    assert triton.cdiv(1024, cfg.block_n) * cfg.k_chunks >= 132  # the wave this tree buys at M = 1


@pytest.mark.parametrize("k", [2048, 1120], ids=["two-chunks-a-leaf", "masked-chunk-tails"])
def test_row_parallel_rule_tree_is_the_same_at_every_tp_size(k):
    """The GPU rule's row-parallel trees (K = 2048: 8 leaves of 2 chunks; K = 1120: 2 leaves of one
    560-wide chunk, 8.75 BLOCK_Ks, its last step masked) on fp32 inputs: each TP rank's chunks,
    computed from its K shard alone with its share of the config, combined in order, give the
    one-process bits on either schedule; shards finer than a chunk, each reduced whole, do not."""
    from dataclasses import replace

    from invariant_infer.kernels.configs import row_parallel_config, tree_leaves
    from invariant_infer.kernels.linear import combine_partials, linear_partials
    cfg = row_parallel_config("cuda", torch.bfloat16, 256, k)
    leaves = tree_leaves(k)
    assert cfg.k_chunks % leaves == 0 and cfg.chunk_k * cfg.k_chunks == k
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, k, generator=g), torch.randn(2 * cfg.block_n, k, generator=g), torch.randn(2 * cfg.block_n)
    one = linear(x, w, b, config=cfg, parallel_chunks=False)
    assert torch.equal(linear(x, w, b, config=cfg, parallel_chunks=True), one)
    for t in (t for t in (2, 4, 8) if leaves % t == 0):
        s = k // t
        parts = torch.cat([linear_partials(x[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s],
                                           replace(cfg, k_chunks=cfg.k_chunks // t)) for r in range(t)])
        assert torch.equal(combine_partials(parts, b, torch.float32), one), t
    pieces = 2 * cfg.k_chunks  # shards finer than a chunk, each reduced as one chunk
    s = k // pieces
    finer = torch.cat([linear_partials(x[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s],
                                       replace(cfg, k_chunks=1, chunk_k=0)) for r in range(pieces)])
    assert not torch.equal(combine_partials(finer, b, torch.float32), one)
