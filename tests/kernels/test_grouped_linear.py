"""Grouped expert GEMM: bitwise a per-expert loop of ``linear`` (and of ``linear(silu_mul(...))``),
a row's bits the same alone and in any grouping, accuracy against float64, the tile map, errors,
the offline CUDA compile, and gpu-marked runs at Qwen3-30B-A3B and Mixtral-8x7B widths."""
import sys

import pytest
import torch
import triton
import triton.language as tl

from helpers.controls import m_dependent_grouped_linear
from helpers.kernel_compile import compile_for, reduction_layouts
from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import LinearConfig, grouped_linear, grouped_silu_mul_linear, linear, linear_config, silu_mul

grouped_mod = sys.modules["invariant_infer.kernels.grouped_linear"]
launch_mod = sys.modules["invariant_infer.kernels.launch"]
linear_mod = sys.modules["invariant_infer.kernels.linear"]

# As in test_linear: max relative error against float64 (bf16 / fp16 outputs rounded to 8 / 11 bits).
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 2e-6}
# Rows per expert: empty experts first, last and between; one row; many; all rows to one expert.
SPLITS = {
    "uneven": [0, 5, 1, 0, 19, 0, 2, 37],
    "one-row-each": [1, 1, 1, 1, 1, 1, 1, 1],
    "all-to-one": [0, 0, 0, 64, 0, 0, 0, 0],
    "last-only": [0, 0, 0, 0, 0, 0, 0, 3],
}


def _offsets(counts, dtype=torch.int64, device="cpu"):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=dtype, device=device)


def _experts(e, n, k, dtype, device, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(e, n, generator=g).to(dtype).to(device) if bias else None
    return w, b


def _rows(t, k, dtype, device, seed=1):
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _loop(x, weight, offsets, bias=None, fn=linear):
    """The reference: one ``fn`` call per expert on that expert's rows."""
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    for e in range(weight.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            out[lo:hi] = fn(x[lo:hi], weight[e], None if bias is None else bias[e])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_is_the_per_expert_loop(dtype, device, split, bias):
    counts = SPLITS[split]
    w, b = _experts(len(counts), 48, 80, dtype, device, bias=bias)
    x = _rows(sum(counts), 80, dtype, device)
    offsets = _offsets(counts, torch.int32 if bias else torch.int64, device)
    with torch.no_grad():
        y = grouped_linear(x, w, offsets, b)
    assert y.dtype == dtype and y.shape == (x.shape[0], 48)
    assert torch.equal(y, _loop(x, w, offsets, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", ["uneven", "all-to-one"])
def test_grouped_silu_mul_linear_is_the_per_expert_loop(dtype, device, split):
    """gate and up as the two halves of one gate_up output (strided views), as an experts layer has them."""
    counts = SPLITS[split]
    w, _ = _experts(len(counts), 40, 56, dtype, device)
    gate_up = _rows(sum(counts), 2 * 56, dtype, device) * 2
    gate, up = gate_up[:, :56], gate_up[:, 56:]
    offsets = _offsets(counts, device=device)
    y = grouped_silu_mul_linear(gate, up, w, offsets)
    assert torch.equal(y, _loop(silu_mul(gate, up), w, offsets))
    assert torch.equal(y, grouped_linear(silu_mul(gate, up), w, offsets))


@pytest.mark.parametrize("dtype", DTYPES)
def test_k_chunk_tree_is_linears(dtype):
    """A config with K cut into 3 chunks: the grouped kernel sums them as linear does, on either of
    linear's schedules."""
    cfg = LinearConfig(16, 32, 32, k_chunks=3)
    counts = SPLITS["uneven"]
    w, b = _experts(len(counts), 40, 200, dtype, "cpu", bias=True)
    x = _rows(sum(counts), 200, dtype, "cpu")
    offsets = _offsets(counts)
    y = grouped_linear(x, w, offsets, b, config=cfg)
    for parallel in (False, True):
        assert torch.equal(y, _loop(x, w, offsets, b, lambda *a: linear(*a, config=cfg, parallel_chunks=parallel)))
    if dtype == torch.float32:  # control: the config is honoured (bf16/fp16 rounding can hide the reordering)
        assert not torch.equal(y, grouped_linear(x, w, offsets, b))


def _row_alone_and_grouped(fn, dtype, device):
    """(row alone, that row in each of several groupings) for rows of expert 2, by ``fn(x, w, offsets)``."""
    experts, k = 6, 512
    w, _ = _experts(experts, 64, k, dtype, device)
    pool = _rows(120, k, dtype, device, seed=3)
    g = torch.Generator().manual_seed(4)
    pairs = []
    for target in (0, 7):
        alone_counts = [0] * experts
        alone_counts[2] = 1
        alone = fn(pool[target:target + 1], w, _offsets(alone_counts, device=device))[0]
        for total in (2, 5, 17, 64, 119):
            others = [r for r in torch.randperm(120, generator=g).tolist() if r != target][:total - 1]
            assign = torch.randint(0, experts, (len(others),), generator=g).tolist()
            groups = [[r for r, a in zip(others, assign) if a == e] for e in range(experts)]
            pos = int(torch.randint(0, len(groups[2]) + 1, (1,), generator=g))  # where it sits in its expert
            groups[2].insert(pos, target)
            y = fn(pool[[r for group in groups for r in group]], w, _offsets([len(gr) for gr in groups], device=device))
            pairs.append((alone, y[len(groups[0]) + len(groups[1]) + pos], total))
    return pairs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_alone_equals_row_in_any_grouping(dtype, device):
    for alone, grouped, total in _row_alone_and_grouped(grouped_linear, dtype, device):
        assert torch.equal(grouped, alone), f"{total} rows"


def test_negative_control_rows_dependent_config_breaks_invariance():
    """The comparison above can fail: with BLOCK_K picked by the largest expert's row count
    (``m_dependent_grouped_linear``), fp32 shows a reordering in almost every element."""
    pairs = _row_alone_and_grouped(m_dependent_grouped_linear, torch.float32, "cpu")
    assert any(not torch.equal(grouped, alone) for alone, grouped, _ in pairs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_float64(dtype, device):
    counts = SPLITS["uneven"]
    w, b = _experts(len(counts), 96, 200, dtype, device, bias=True)
    x = _rows(sum(counts), 200, dtype, device)
    gate, up = _rows(sum(counts), 200, dtype, device, seed=5), _rows(sum(counts), 200, dtype, device, seed=6)
    offsets = _offsets(counts, device=device)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
    ref = torch.einsum("tk,tnk->tn", x.double(), w.double()[expert]) + b.double()[expert]
    y = grouped_linear(x, w, offsets, b)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[dtype]
    act = torch.nn.functional.silu(gate.double()) * up.double()
    ref = torch.einsum("tk,tnk->tn", act, w.double()[expert])
    y = grouped_silu_mul_linear(gate, up, w, offsets)
    # The prologue rounds silu(gate) and the product to the dtype, as the unfused pair does.
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 2 * TOLERANCE[dtype]


@triton.jit
def _tile_probe_kernel(offsets_ptr, out_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    slot = tl.program_id(0)
    expert, tile, row_begin, rows = grouped_mod._find_tile(offsets_ptr, slot, E, BLOCK_M, BLOCK_E)
    tl.store(out_ptr + slot * 4 + tl.arange(0, 4), tl.where(tl.arange(0, 4) == 0, expert, tl.where(
        tl.arange(0, 4) == 1, tile, tl.where(tl.arange(0, 4) == 2, row_begin, rows))))


def test_tile_map_gives_empty_experts_no_tiles():
    """Experts of 0, 130 (three 64-row tiles), 0 and 1 rows: tiles for experts 1 and 3 only; the
    spare slots of the worst-case grid (ceil(131 / 64) + 4 = 7) name an expert >= E = 4 and exit."""
    offsets = _offsets([0, 130, 0, 1])
    slots = grouped_mod.grid_slots(131, 4, 64)
    out = torch.full((slots, 4), -1, dtype=torch.int64)
    launch_mod.launch(_tile_probe_kernel, (slots,), out.device, offsets, out, 4, BLOCK_M=64, BLOCK_E=4)
    assert slots == 7
    assert out[:4].tolist() == [[1, 0, 0, 130], [1, 1, 0, 130], [1, 2, 0, 130], [3, 0, 130, 1]]
    assert bool((out[4:, 0] >= 4).all())


def test_no_rows_and_no_experts_launch_nothing():
    w, _ = _experts(4, 8, 16, torch.float32, "cpu")
    assert grouped_linear(torch.empty(0, 16), w, torch.zeros(5, dtype=torch.int64)).shape == (0, 8)
    y = grouped_linear(torch.empty(0, 16), torch.empty(0, 8, 16), torch.zeros(1, dtype=torch.int64))
    assert y.shape == (0, 8)


def test_one_expert_is_linear():
    w, _ = _experts(1, 24, 40, torch.bfloat16, "cpu")
    x = _rows(70, 40, torch.bfloat16, "cpu")
    assert torch.equal(grouped_linear(x, w, _offsets([70])), linear(x, w[0]))


def test_transposed_expert_weights_are_read_through_their_strides():
    """A weight stored [E, K, N] (as some checkpoints do) passed as its [E, N, K] view."""
    w, _ = _experts(3, 24, 40, torch.float32, "cpu")
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    x, offsets = _rows(9, 40, torch.float32, "cpu"), _offsets([4, 0, 5])
    assert torch.equal(grouped_linear(x, w_t, offsets), _loop(x, w, offsets))


def test_rejects_bad_arguments():
    w, b = _experts(3, 8, 16, torch.float32, "cpu", bias=True)
    x = torch.randn(4, 16)
    offsets = _offsets([1, 2, 1])
    with pytest.raises(ValueError, match=r"weight must be \[E, N, K\]"):
        grouped_linear(x, w[0], offsets)
    with pytest.raises(ValueError, match="x must be"):
        grouped_linear(torch.randn(4, 15), w, offsets)
    with pytest.raises(TypeError, match="share a dtype"):
        grouped_linear(x.double(), w, offsets)
    with pytest.raises(ValueError, match="bias must be"):
        grouped_linear(x, w, offsets, b[0])
    with pytest.raises(ValueError, match="expert_offsets must be int32/int64"):
        grouped_linear(x, w, offsets.float())
    with pytest.raises(ValueError, match="expert_offsets must be int32/int64"):
        grouped_linear(x, w, offsets[:-1])
    for bad in ([0, 1, 3, 5], [1, 1, 3, 4], [0, 3, 1, 4]):
        with pytest.raises(ValueError, match="must rise from 0 to T"):
            grouped_linear(x, w, torch.tensor(bad))
    with pytest.raises(ValueError, match="gate"):
        grouped_silu_mul_linear(x, x[:, :8], w, offsets)


def test_refuses_to_run_where_autograd_would_record():
    """The kernels have no backward: with grad recorded they refuse rather than return a result with none."""
    w, _ = _experts(3, 8, 16, torch.float32, "cpu")
    x, offsets = torch.randn(4, 16), _offsets([1, 2, 1])
    with pytest.raises(RuntimeError, match="no backward"):
        grouped_linear(x, w.requires_grad_(), offsets)
    with pytest.raises(RuntimeError, match="no backward"):
        grouped_silu_mul_linear(x.requires_grad_(), x, w, offsets)
    with torch.no_grad():
        assert torch.equal(grouped_linear(x, w, offsets), _loop(x, w.detach(), offsets))


# The expert shapes (N, K) of the real models: Qwen3-30B-A3B (hidden 2048, expert intermediate 768)
# and Mixtral-8x7B (hidden 4096, intermediate 14336).
REAL_SHAPES = {"qwen3-30b-a3b gate_up": (1536, 2048), "qwen3-30b-a3b down": (2048, 768),
               "mixtral-8x7b gate_up": (28672, 4096), "mixtral-8x7b down": (4096, 14336)}


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("shape", list(REAL_SHAPES.values()), ids=list(REAL_SHAPES))
def test_cuda_configs_of_the_real_expert_shapes_in_the_interpreter(shape):
    """The CUDA config of each real expert shape, run through the interpreter on two N tiles of the
    weights (the real K, so the real reduction order; a column's bits do not depend on N): bitwise
    the per-expert loop of linear on both of its schedules, and the row alone."""
    n, k = shape
    cfg = linear_config("cuda", torch.bfloat16, n, k)
    w, _ = _experts(3, 2 * cfg.block_n, k, torch.bfloat16, "cpu")
    x, offsets = _rows(6, k, torch.bfloat16, "cpu"), _offsets([1, 0, 5])
    y = grouped_linear(x, w, offsets, config=cfg)
    for parallel in (False, True):
        assert torch.equal(y, _loop(x, w, offsets, None, lambda *a: linear(*a, config=cfg, parallel_chunks=parallel)))
    assert torch.equal(grouped_linear(x[3:4], w, _offsets([0, 0, 1]), config=cfg)[0], y[3])


TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _dot_layouts(compiled) -> list[str]:
    """The dots' operand and accumulator layouts (the grouped kernel's tile search adds integer
    reductions of its own, which sum no data)."""
    dots = [ops for ops in reduction_layouts(compiled) if " * " in ops]
    assert dots, "no dot found"
    return dots


@pytest.mark.fast_cells(2)
@pytest.mark.parametrize("arch", [90, 89, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiles_for_cuda_with_linears_dot_layouts(arch, dtype):
    """Offline compile (no GPU needed) with the CUDA config of each real expert shape, both
    prologues (128 experts); the dot's operand and accumulator layouts (the MMA instruction, hence the
    order each element is summed in) are those of the linear kernel with the same config, although
    the grouped kernel addresses its expert's rows from an offset the compiler cannot see aligned."""
    configs = {linear_config("cuda", dtype, n, k) for n, k in REAL_SHAPES.values()}
    for cfg in sorted(configs, key=str):
        for prologue in (linear_mod.PROLOGUE_NONE, linear_mod.PROLOGUE_SILU_MUL):
            common = dict(HAS_BIAS=True, K_CHUNKS=cfg.k_chunks, PROLOGUE=prologue, BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="ieee")
            grouped = compile_for(grouped_mod._grouped_linear_kernel, arch,
                                  {"ptr": f"*{TL_DTYPE[dtype]}", "offsets_ptr": "*i64"}, dict(common, BLOCK_E=128),
                                  cfg.num_warps, cfg.num_stages)
            if arch != 90 and prologue == linear_mod.PROLOGUE_SILU_MUL:
                continue  # one comparison per arch and dtype keeps the compiles few
            alone = compile_for(linear_mod._linear_kernel, arch, {"ptr": f"*{TL_DTYPE[dtype]}"},
                                dict(common, PARALLEL_CHUNKS=False, GROUP_M=cfg.group_m), cfg.num_warps,
                                cfg.num_stages)
            assert _dot_layouts(grouped) == _dot_layouts(alone)


@pytest.mark.parametrize("block_e", [1, 8, 512])
def test_compiles_for_cuda_at_other_expert_counts(block_e):
    cfg = linear_config("cuda", torch.bfloat16, 2048, 768)
    compile_for(grouped_mod._grouped_linear_kernel, 90, {"ptr": "*bf16", "offsets_ptr": "*i32"},
                dict(HAS_BIAS=False, K_CHUNKS=cfg.k_chunks, PROLOGUE=linear_mod.PROLOGUE_SILU_MUL, BLOCK_M=cfg.block_m,
                     BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=block_e, DOT_PRECISION="ieee"),
                cfg.num_warps, cfg.num_stages)


def _routed_rows(tokens, experts, top_k, device, seed=0):
    """Offsets of ``tokens * top_k`` rows routed uniformly at random, each token to top_k distinct experts."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k].reshape(-1)
    return _offsets(torch.bincount(picks, minlength=experts).tolist(), device=device)


def _one_layers_experts(experts, hidden, inter, tokens, top_k, device):
    """One layer's experts: gate_up and the fused down projection are bitwise the per-expert loop
    of linear, and rows alone (the first, the busiest expert's first, the last) equal rows in the batch."""
    dtype = torch.bfloat16
    offsets = _routed_rows(tokens, experts, top_k, device)
    rows = int(offsets[-1])
    gate_up_w, _ = _experts(experts, 2 * inter, hidden, dtype, device)
    down_w, _ = _experts(experts, hidden, inter, dtype, device, seed=1)
    x = _rows(rows, hidden, dtype, device)
    with torch.no_grad():
        gate_up = grouped_linear(x, gate_up_w, offsets)
        assert torch.equal(gate_up, _loop(x, gate_up_w, offsets))
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        down = grouped_silu_mul_linear(gate, up, down_w, offsets)
        assert torch.equal(down, _loop(silu_mul(gate, up), down_w, offsets))
        busiest = int((offsets[1:] - offsets[:-1]).argmax())
        for row in (0, int(offsets[busiest]), rows - 1):
            e = int(torch.searchsorted(offsets, torch.tensor(row, device=device), right=True)) - 1
            one = _offsets([1 if i == e else 0 for i in range(experts)], device=device)
            assert torch.equal(grouped_linear(x[row:row + 1], gate_up_w, one)[0], gate_up[row])
            assert torch.equal(grouped_silu_mul_linear(gate[row:row + 1], up[row:row + 1], down_w, one)[0], down[row])


def test_one_layers_experts_at_test_widths():
    """The check the GPU runs at the real widths, at the widths of the CPU test models."""
    _one_layers_experts(8, 64, 32, 40, 2, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("experts, hidden, inter, tokens, top_k", [(128, 2048, 768, 256, 8), (8, 4096, 14336, 300, 2)],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_gpu_real_widths(experts, hidden, inter, tokens, top_k):
    """One layer's experts at Qwen3-30B-A3B and Mixtral-8x7B widths on a GPU (a few hundred tokens)."""
    _one_layers_experts(experts, hidden, inter, tokens, top_k, "cuda")
