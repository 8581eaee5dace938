"""MoE routing: softmax, top-k and renormalisation against float64 torch where there are no ties,
the tie rule (lowest expert index) on exact ties, renormalisation in rank order, a row's bits the
same alone and in any batch (with a batch-dependent control), errors, the offline CUDA compile and
a gpu-marked run at Qwen3-30B-A3B widths."""
import sys

import pytest
import torch
import triton

from helpers.kernel_compile import compile_for
from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import moe_routing

routing_mod = sys.modules["invariant_infer.kernels.moe_routing"]
BATCH_SIZES = [1, 2, 7, 16, 17, 33, 100]
# (experts, top_k) of Qwen3-30B-A3B, Mixtral, Qwen2-MoE (60 experts: not a power of two), the top_k cap.
ROUTERS = [(128, 8), (8, 2), (60, 4), (32, 16)]


def _distinct_logits(rows, experts, dtype, device, seed=0):
    """Per row a shuffled ladder of multiples of 1/16 (exact in bf16 and fp16, at most 16 apart):
    no two probabilities are equal, so top-k has one answer."""
    g = torch.Generator().manual_seed(seed)
    ladder = torch.stack([torch.randperm(experts, generator=g) for _ in range(rows)]) - experts // 2
    scale = torch.randint(1, 4, (rows, 1), generator=g)
    return (ladder * scale / 16).to(dtype).to(device)


def _reference(logits, top_k, normalize):
    p = torch.softmax(logits.double(), dim=-1)
    top, index = torch.topk(p, top_k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if normalize else top), index


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, top_k", ROUTERS)
@pytest.mark.parametrize("normalize", [True, False])
def test_against_float64_without_ties(dtype, device, experts, top_k, normalize):
    logits = _distinct_logits(37, experts, dtype, device)
    weights, chosen = moe_routing(logits, top_k, normalize)
    ref_weights, ref_index = _reference(logits, top_k, normalize)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64 and weights.shape == (37, top_k)
    assert torch.equal(chosen, ref_index)
    # fp32 softmax: a few ulps of exp and the sum over E experts.
    assert (weights.double() - ref_weights).abs().max().item() < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_random_fp32_logits_against_float64(device):
    """Unstructured logits: rows whose float64 top-k has a near tie (closer than fp32 can resolve) are left out."""
    logits = torch.randn(200, 128, generator=torch.Generator().manual_seed(1)).to(device)
    weights, chosen = moe_routing(logits, 8, True)
    ref_weights, ref_index = _reference(logits, 9, False)
    clear = (ref_weights[:, :-1] - ref_weights[:, 1:]).min(dim=1).values > 1e-6
    assert clear.sum() > 150
    assert torch.equal(chosen[clear], ref_index[clear, :8])
    ref = _reference(logits, 8, True)[0]
    assert (weights.double() - ref).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_ties_go_to_the_lowest_expert_index(dtype):
    """Equal logits give equal probabilities: those experts come in index order, and their weights are equal."""
    experts = 16
    g = torch.Generator().manual_seed(2)
    rows = [torch.zeros(experts)]  # all equal: experts 0..k-1
    for _ in range(20):  # a few levels, each shared by several experts at random places
        levels = torch.tensor([2.0, 1.0, 0.5, -1.0])
        rows.append(levels[torch.randint(0, 4, (experts,), generator=g)])
    logits = torch.stack(rows).to(dtype)
    for top_k in (1, 4, 7, 16):
        weights, chosen = moe_routing(logits, top_k, normalize=False)
        for r in range(logits.shape[0]):
            values = logits[r].float().tolist()
            expected = sorted(range(experts), key=lambda e: (-values[e], e))[:top_k]
            assert chosen[r].tolist() == expected, (r, top_k)
            for a in range(top_k):
                for b in range(top_k):
                    if values[expected[a]] == values[expected[b]]:
                        assert weights[r, a].item() == weights[r, b].item()
    assert moe_routing(torch.zeros(3, 8), 3, True)[1].tolist() == [[0, 1, 2]] * 3


@pytest.mark.parametrize("experts, top_k", ROUTERS)
def test_renormalisation_divides_by_the_sum_in_rank_order(experts, top_k):
    logits = torch.randn(50, experts, generator=torch.Generator().manual_seed(3))
    raw, chosen = moe_routing(logits, top_k, normalize=False)
    normalized, chosen_normalized = moe_routing(logits, top_k, normalize=True)
    assert torch.equal(chosen, chosen_normalized)
    total = raw[:, 0].clone()
    for rank in range(1, top_k):
        total += raw[:, rank]
    assert torch.equal(normalized, raw / total[:, None])  # IEEE division, as the kernel's div_rn
    assert (normalized.double().sum(-1) - 1).abs().max().item() < 1e-6
    assert bool((raw[:, :-1] >= raw[:, 1:]).all())  # descending


def _alone_and_in_batches(route, dtype, device, experts=128, top_k=8):
    """(row alone, that row in a batch) for batches of every size in BATCH_SIZES, by ``route``."""
    pool = torch.randn(max(BATCH_SIZES), experts, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    alone = [route(pool[i:i + 1], top_k) for i in range(4)]
    g = torch.Generator().manual_seed(5)
    pairs = []
    for m in BATCH_SIZES:
        for pos in sorted({0, m // 2, m - 1}):
            i = (m + pos) % 4
            batch = pool[torch.randperm(pool.shape[0], generator=g)[:m]].clone()
            batch[pos] = pool[i]
            out = route(batch, top_k)
            pairs.append(((alone[i][0][0], alone[i][1][0]), (out[0][pos], out[1][pos]), m))
    return pairs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_alone_equals_row_in_any_batch(dtype, device):
    for (w_alone, e_alone), (w_batch, e_batch), m in _alone_and_in_batches(
            lambda x, k: moe_routing(x, k, True), dtype, device):
        assert torch.equal(w_batch, w_alone) and torch.equal(e_batch, e_alone), f"M={m}"


def test_row_alone_equals_row_of_a_strided_view():
    """Rows of a wider tensor (another row stride, an unaligned start) are reduced as their copies."""
    wide = torch.randn(9, 70, generator=torch.Generator().manual_seed(6)).bfloat16()
    view = wide[1:, 3:63]
    weights, chosen = moe_routing(view, 4, True)
    for r in (0, 5, 7):
        alone = moe_routing(view[r:r + 1].clone(), 4, True)
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], chosen[r])


def _batch_dependent_routing(logits, top_k):
    """Negative control: the softmax's sum over experts split into partial sums whose count depends
    on the number of rows, as a split-reduction heuristic keyed by batch size would."""
    x = logits.float()
    num = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    parts = num.reshape(num.shape[0], 4 if x.shape[0] > 8 else 1, -1).sum(-1)
    total = parts[:, 0]
    for j in range(1, parts.shape[1]):
        total = total + parts[:, j]
    top, index = torch.topk(num / total[:, None], top_k, dim=-1)
    return top / top.sum(-1, keepdim=True), index


def test_negative_control_batch_dependent_reduction_breaks_invariance():
    pairs = _alone_and_in_batches(_batch_dependent_routing, torch.float32, "cpu")
    assert any(not torch.equal(w_batch, w_alone) for (w_alone, _), (w_batch, _), _ in pairs)


def test_rejects_bad_arguments():
    logits = torch.randn(4, 8)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="top_k must be"):
            moe_routing(logits, bad, True)
    with pytest.raises(ValueError, match="top_k must be"):
        moe_routing(torch.randn(4, 40), 17, True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        moe_routing(logits[0], 2, True)
    with pytest.raises(TypeError, match="dtype"):
        moe_routing(logits.double(), 2, True)
    with pytest.raises(RuntimeError, match="no backward"):
        moe_routing(logits.requires_grad_(), 2, True)
    weights, chosen = moe_routing(torch.empty(0, 8), 2, True)
    assert weights.shape == (0, 2) and chosen.shape == (0, 2)


def test_nan_logits_still_name_distinct_experts_in_range():
    """A NaN in a row (a broken model) must not index past the experts downstream."""
    logits = torch.randn(3, 8)
    logits[1, 3] = float("nan")
    _, chosen = moe_routing(logits, 4, True)
    assert bool(((chosen >= 0) & (chosen < 8)).all())
    assert all(len(set(row)) == 4 for row in chosen.tolist())


TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.mark.fast_cells(2)
@pytest.mark.parametrize("arch", [90, 89, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiles_for_cuda(arch, dtype):
    for experts, top_k in ROUTERS + [(128, 1)]:
        for normalize in (True, False):
            compile_for(routing_mod._moe_routing_kernel, arch,
                        {"ptr": f"*{TL_DTYPE[dtype]}", "weights_ptr": "*fp32", "experts_ptr": "*i64"},
                        dict(TOP_K=top_k, NORMALIZE=normalize, BLOCK_ROWS=1, BLOCK_E=triton.next_power_of_2(experts),
                             BLOCK_K=triton.next_power_of_2(top_k)))


def _router(tokens, experts, top_k, device):
    """float64 agreement on the rows without a near tie, and rows alone equal to rows in the batch."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(7)).bfloat16().to(device)
    weights, chosen = moe_routing(logits, top_k, True)
    ref_weights, ref_index = _reference(logits, top_k + 1, False)
    clear = (ref_weights[:, :-1] - ref_weights[:, 1:]).min(dim=1).values > 1e-6
    assert clear.sum() > tokens // 2
    assert torch.equal(chosen[clear], ref_index[clear, :top_k])
    assert (weights.double() - _reference(logits, top_k, True)[0]).abs().max().item() < 1e-6
    for r in (0, tokens // 2, tokens - 1):
        alone = moe_routing(logits[r:r + 1], top_k, True)
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], chosen[r])


def test_router_at_test_widths():
    """The check the GPU runs at Qwen3-30B-A3B widths, at the widths of the CPU test models."""
    _router(40, 8, 2, "cpu")


@pytest.mark.gpu
def test_gpu_qwen3_30b_a3b_router():
    """2048 tokens, 128 experts, top-8 on a GPU."""
    _router(2048, 128, 8, "cuda")
