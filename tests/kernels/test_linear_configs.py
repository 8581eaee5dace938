"""The GEMM config rule (pure Python, no kernel runs): every GEMM of the supported families' released
widths launches at least one wave of an H100 at small M, takes Hopper-sized tiles at large M, and
keeps a K tree that tensor-parallel shards split into whole chunks."""
import inspect

import pytest
import torch
import triton

from invariant_infer.kernels.configs import linear_config, row_parallel_config
from invariant_infer.kernels.linear_configs import (MIN_CHUNK_STEPS, TARGET_PROGRAMS, _gpu_tiles, _plain_tree,
                                                    chunk_length, gpu_linear_config, tree_leaves)

SM89_SHARED_MEMORY = 101376  # bytes a block may use on sm_89 (sm_80 and sm_90 allow more)


def _dense(hidden, heads, kv_heads, head_dim, intermediate, vocab, q_outputs=1):
    """(role, row-parallel) -> (N, K) of a dense decoder layer and its lm_head."""
    return {("q", False): (q_outputs * heads * head_dim, hidden), ("k/v", False): (kv_heads * head_dim, hidden),
            ("o", True): (hidden, heads * head_dim), ("gate/up", False): (intermediate, hidden),
            ("down", True): (hidden, intermediate), ("lm_head", False): (vocab, hidden)}


_MODELS = {
    "qwen2.5-1.5b": _dense(1536, 12, 2, 128, 8960, 151936),
    "qwen2.5-7b": _dense(3584, 28, 4, 128, 18944, 152064),
    "llama-3.1-8b": _dense(4096, 32, 8, 128, 14336, 128256),
    "qwen3-8b": _dense(4096, 32, 8, 128, 12288, 151936),
    # attention projections and lm_head: its MoE experts run on the grouped kernels; its router
    # (32 outputs) is left out, as are Qwen3.5's a/b gates (48): too narrow to fill a wave
    "gpt-oss-20b": {key: shape for key, shape in _dense(2880, 64, 8, 64, 2880, 201088).items()
                    if key[0] not in ("gate/up", "down")},
    # gated attention (q_proj gives the query and its gate), and the Gated DeltaNet projections
    "qwen3.5-27b": {**_dense(5120, 24, 4, 256, 17408, 248320, q_outputs=2),
                    ("in_proj_qkv", False): (10240, 5120), ("in_proj_z", False): (6144, 5120),
                    ("out_proj", True): (5120, 6144)},
    "gemma-3-12b": _dense(3840, 16, 8, 256, 15360, 262208),
}
FAMILY_SHAPES = {(model, role, row): shape for model, shapes in _MODELS.items() for (role, row), shape in shapes.items()}
CASES = [pytest.param(row, shape, id=f"{model}-{role}") for (model, role, row), shape in FAMILY_SHAPES.items()]


def _config(row: bool, n: int, k: int, dtype=torch.bfloat16):
    return (row_parallel_config if row else linear_config)("cuda", dtype, n, k)


def _programs(cfg, m, n):
    """Programs of the parallel schedule at M rows."""
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * cfg.k_chunks


@pytest.mark.parametrize("row, shape", CASES)
def test_every_family_gemm_fills_a_wave_at_small_m_and_takes_large_tiles(row, shape):
    n, k = shape
    cfg = _config(row, n, k)
    for m in (1, 16, 64):
        assert _programs(cfg, m, n) >= TARGET_PROGRAMS, (m, cfg)
    assert cfg.block_m >= 128 and cfg.block_k == 64
    if cfg.block_n < 128:  # narrower only where the 128 x 128 tile cannot fill the wave
        wide = _plain_tree(_gpu_tiles(torch.bfloat16)[0], n, k)
        assert _programs(wide, 1, n) < TARGET_PROGRAMS or row, cfg
        assert _programs(cfg, 4096, n) >= _programs(wide, 4096, n) // wide.k_chunks
    else:
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (128, 128, 8)
    # each chunk at least MIN_CHUNK_STEPS BLOCK_Ks (where its leaf has them), chunks covering K
    chunk = chunk_length(cfg, k)
    assert (cfg.k_chunks - 1) * chunk < k <= cfg.k_chunks * chunk
    leaf = k // tree_leaves(k) if row else k
    assert cfg.k_chunks == 1 or chunk >= min(leaf, MIN_CHUNK_STEPS * cfg.block_k)


@pytest.mark.parametrize("row, shape", [case for case in CASES if case.values[0]])
def test_row_parallel_trees_split_into_whole_chunks_at_every_tp_size(row, shape):
    """A row-parallel layer's chunks never straddle a leaf, so TP ranks holding whole leaves hold
    whole chunks: the rank's share of the tree is the tree of its K shard."""
    n, k = shape
    cfg = _config(row, n, k)
    leaves = tree_leaves(k)
    assert cfg.k_chunks % leaves == 0 and (k // leaves) % cfg.chunk_k == 0 and cfg.k_chunks * cfg.chunk_k == k
    for t in (t for t in (2, 4, 8) if leaves % t == 0):
        assert (k // t) % cfg.chunk_k == 0 and cfg.k_chunks % t == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_tile_fits_sm89_shared_memory(dtype):
    size = dtype.itemsize
    for tile in _gpu_tiles(dtype):
        stage = (tile.block_m * tile.block_k + tile.block_k * tile.block_n) * size
        assert stage * tile.num_stages <= SM89_SHARED_MEMORY, tile


def test_equal_chunks_where_k_allows():
    """Qwen3-8B's k/v: K = 4096 is 64 BLOCK_Ks, cut into 32 equal chunks of 2; gpt-oss' K = 2880
    (45 BLOCK_Ks) into chunks of 2, the last one a single step."""
    cfg = gpu_linear_config(torch.bfloat16, 1024, 4096)
    assert (cfg.k_chunks, cfg.chunk_k) == (32, 128)
    cfg = gpu_linear_config(torch.bfloat16, 512, 2880)
    assert cfg.chunk_k == 128 and cfg.k_chunks == 23


def test_the_rule_reads_no_batch_size_and_no_device():
    for fn in (linear_config, row_parallel_config, gpu_linear_config):
        assert not {"m", "rows", "batch", "device"} & set(inspect.signature(fn).parameters)
    # the same tree for every GPU: the rule's constant, not an SM count read from a device
    assert TARGET_PROGRAMS == 132


QUANTIZED_FORMATS = {"w4a16-g128": dict(format="packed", bits=4, group_size=128), "fp8-block": dict(format="fp8", block=True),
                     "fp8-channel": dict(format="fp8"), "int8-channel": dict(format="int8")}


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_quantized_gemms_follow_the_same_rule(fmt):
    """The quantized GEMMs' configs at the same shapes: at least a wave at one row tile, each K chunk
    whole scale groups (and whole BLOCK_Ks) and at least MIN_CHUNK_K long."""
    from invariant_infer.kernels.linear_configs import MIN_CHUNK_K
    from invariant_infer.kernels.quantized_linear import QuantizedWeight, quantized_linear_config
    for n, k in FAMILY_SHAPES.values():
        weight = QuantizedWeight(data=torch.empty(0), scale=torch.empty(0), shape=(n, k), **QUANTIZED_FORMATS[fmt])
        cfg = quantized_linear_config("cuda", weight)
        assert triton.cdiv(n, cfg.block_n) * cfg.k_chunks >= TARGET_PROGRAMS, (n, k, cfg)
        if cfg.k_chunks > 1:
            group = weight.scale_group_k if weight.scale_group_k < k else cfg.block_k
            assert cfg.chunk_k % group == 0 and cfg.chunk_k % cfg.block_k == 0 and cfg.chunk_k >= MIN_CHUNK_K
            assert (cfg.k_chunks - 1) * cfg.chunk_k < k <= cfg.k_chunks * cfg.chunk_k
