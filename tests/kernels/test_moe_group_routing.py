"""Group-limited sigmoid routing with a selection bias (DeepSeek-V3, GLM-4.5): against a float64
reference (one and several groups, fewer kept groups than groups, renormalisation on and off,
scaling), the tie rule (lowest group, then lowest expert), renormalisation in rank order, a row's
bits the same alone and in any batch (with a batch-dependent control), NaN and padding, errors,
the offline CUDA compile, and a gpu-marked run at DeepSeek-V3 widths."""
import sys

import pytest
import torch
import triton

from helpers.kernel_compile import compile_for
from helpers.models import DEVICES
from invariant_infer.kernels import moe_group_routing

routing_mod = sys.modules["invariant_infer.kernels.moe_group_routing"]
BATCH_SIZES = [1, 2, 7, 16, 17, 33, 100]
# (experts, top_k, n_group, topk_group): GLM-4.5-Air, DeepSeek-V3, GLM-4.6 (160: not a power of two),
# 3 groups of 20 (both block axes padded), the tiny test models' router.
ROUTERS = [(128, 8, 1, 1), (256, 8, 8, 4), (160, 8, 1, 1), (60, 4, 3, 2), (8, 2, 2, 1)]


def _reference(logits, bias, top_k, n_group, topk_group, normalize, scaling):
    """float64, as transformers' Glm4MoeTopkRouter / DeepseekV3TopkRouter after the linear; the
    experts in descending selection score. Also whether each row's choices are clear (every gap
    that decides them wider than fp32 rounding could close)."""
    s = torch.sigmoid(logits.double())
    choice = s + bias.double()
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    ranked_groups = group_scores.sort(dim=-1, descending=True).values
    kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1)
    masked = choice.masked_fill(~kept.bool().repeat_interleave(e // n_group, dim=1), float("-inf"))
    ranked = masked.sort(dim=-1, descending=True)
    index = ranked.indices[:, :top_k]
    weights = s.gather(1, index)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    gaps = ranked.values[:, :top_k + 1].diff(dim=-1).abs()
    clear = gaps.nan_to_num(1.0).min(-1).values > 1e-5
    if topk_group < n_group:
        clear &= (ranked_groups[:, topk_group - 1] - ranked_groups[:, topk_group]) > 1e-5
    return weights * scaling, index, clear


def _inputs(rows, experts, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, experts, generator=g) * 2, torch.randn(experts, generator=g) * 0.2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts, top_k, n_group, topk_group", ROUTERS)
@pytest.mark.parametrize("normalize, scaling", [(True, 1.0), (False, 1.0), (True, 2.5)])
def test_against_float64(device, experts, top_k, n_group, topk_group, normalize, scaling):
    logits, bias = _inputs(200, experts, seed=experts + top_k)
    weights, chosen = moe_group_routing(logits.to(device), bias.to(device), top_k, n_group, topk_group, normalize,
                                        scaling)
    ref_weights, ref_index, clear = _reference(logits, bias, top_k, n_group, topk_group, normalize, scaling)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64 and weights.shape == (200, top_k)
    assert clear.sum() > 100
    assert torch.equal(chosen.cpu()[clear], ref_index[clear])
    # fp32 sigmoid (exp, one division) and a sum of k: a few ulps of numbers up to `scaling`.
    assert (weights.cpu().double()[clear] - ref_weights[clear]).abs().max().item() < 1e-6 * scaling


def test_the_bias_selects_and_the_groups_limit():
    """Negative checks of the reference comparison: without the bias, or with every group kept, other
    experts are chosen in most rows; the weights are the sigmoid scores, not score + bias."""
    logits, bias = _inputs(200, 8, seed=11)
    bias = bias * 5
    weights, chosen = moe_group_routing(logits, bias, 2, 2, 1, False)
    score = torch.sigmoid(logits.double()).gather(1, chosen)
    assert (weights.double() - score).abs().max().item() < 1e-6
    assert (weights.double() - score - bias.double()[chosen]).abs().min().item() > 1e-3
    unbiased = moe_group_routing(logits, torch.zeros(8), 2, 2, 1, False)[1]
    all_groups = moe_group_routing(logits, bias, 2, 2, 2, False)[1]
    assert (chosen != unbiased).any(-1).sum() > 50
    assert (chosen != all_groups).any(-1).sum() > 20
    kept_group = chosen // 4
    assert bool((kept_group[:, 0] == kept_group[:, 1]).all())  # topk_group 1: both from one group


def test_exact_ties_go_to_the_lowest_group_then_the_lowest_expert():
    """Equal logits and biases give equal selection scores (and equal group scores for equal pairs):
    the lower group is kept and the lower experts chosen, and equal experts weigh the same."""
    experts, n_group = 16, 4
    g = torch.Generator().manual_seed(2)
    levels = torch.tensor([2.0, 1.0, 0.5, -1.0])
    rows = [torch.zeros(experts)] + [levels[torch.randint(0, 4, (experts,), generator=g)] for _ in range(30)]
    logits = torch.stack(rows)
    bias = torch.zeros(experts)
    for top_k, topk_group in ((1, 1), (4, 2), (3, 3), (8, 4)):
        weights, chosen = moe_group_routing(logits, bias, top_k, n_group, topk_group, normalize=False)
        for r, row in enumerate(logits.tolist()):
            score = [torch.sigmoid(torch.tensor(v, dtype=torch.float64)).item() for v in row]
            size = experts // n_group
            group_score = [sum(sorted(score[i * size:(i + 1) * size], reverse=True)[:2]) for i in range(n_group)]
            kept = sorted(range(n_group), key=lambda i: (-group_score[i], i))[:topk_group]
            candidates = [x for x in range(experts) if x // size in kept]
            expected = sorted(candidates, key=lambda x: (-score[x], x))[:top_k]
            assert chosen[r].tolist() == expected, (r, top_k, topk_group)
            for a in range(top_k):
                for b in range(top_k):
                    if row[expected[a]] == row[expected[b]]:
                        assert weights[r, a].item() == weights[r, b].item()
    assert moe_group_routing(torch.zeros(3, 8), torch.zeros(8), 3, 2, 1, True)[1].tolist() == [[0, 1, 2]] * 3


@pytest.mark.parametrize("experts, top_k, n_group, topk_group", ROUTERS)
def test_renormalisation_divides_by_the_sum_in_rank_order_then_scales(experts, top_k, n_group, topk_group):
    logits, bias = _inputs(50, experts, seed=3)
    raw, chosen = moe_group_routing(logits, bias, top_k, n_group, topk_group, normalize=False)
    scaled, chosen_scaled = moe_group_routing(logits, bias, top_k, n_group, topk_group, normalize=True, scaling=2.5)
    assert torch.equal(chosen, chosen_scaled)
    total = raw[:, 0].clone()
    for rank in range(1, top_k):
        total += raw[:, rank]
    assert torch.equal(scaled, raw / (total[:, None] + 1e-20) * 2.5)  # IEEE division, as the kernel's div_rn
    key = (torch.sigmoid(logits.double()) + bias.double()).gather(1, chosen)
    assert bool((key[:, :-1] >= key[:, 1:]).all())  # descending selection score


def _alone_and_in_batches(route, device, experts=256, top_k=8):
    """(row alone, that row in a batch) for batches of every size in BATCH_SIZES, by ``route``."""
    pool, bias = _inputs(max(BATCH_SIZES), experts, seed=4)
    pool, bias = pool.to(device), bias.to(device)
    alone = [route(pool[i:i + 1], bias, top_k) for i in range(4)]
    g = torch.Generator().manual_seed(5)
    pairs = []
    for m in BATCH_SIZES:
        for pos in sorted({0, m // 2, m - 1}):
            i = (m + pos) % 4
            batch = pool[torch.randperm(pool.shape[0], generator=g)[:m]].clone()
            batch[pos] = pool[i]
            out = route(batch, bias, top_k)
            pairs.append(((alone[i][0][0], alone[i][1][0]), (out[0][pos], out[1][pos]), m))
    return pairs


@pytest.mark.parametrize("device", DEVICES)
def test_row_alone_equals_row_in_any_batch(device):
    for (w_alone, e_alone), (w_batch, e_batch), m in _alone_and_in_batches(
            lambda x, b, k: moe_group_routing(x, b, k, 8, 4, True, 2.5), device):
        assert torch.equal(w_batch, w_alone) and torch.equal(e_batch, e_alone), f"M={m}"


def test_row_alone_equals_row_of_a_strided_view():
    """Rows of a wider tensor (another row stride, an unaligned start) are reduced as their copies."""
    wide = torch.randn(9, 70, generator=torch.Generator().manual_seed(6)).bfloat16()
    view, bias = wide[1:, 3:63], torch.randn(60, generator=torch.Generator().manual_seed(7))
    weights, chosen = moe_group_routing(view, bias, 4, 3, 2, True)
    for r in (0, 5, 7):
        alone = moe_group_routing(view[r:r + 1].clone(), bias, 4, 3, 2, True)
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], chosen[r])


def _batch_dependent_routing(logits, bias, top_k):
    """Negative control: the kernel's choices, with the renormalising sum taken in reverse rank order
    when the batch has more than 8 rows, as a batch-size-keyed reduction order would."""
    weights, chosen = moe_group_routing(logits, bias, top_k, 8, 4, False)
    order = range(top_k - 1, -1, -1) if logits.shape[0] > 8 else range(top_k)
    total = torch.zeros(weights.shape[0])
    for rank in order:
        total = total + weights[:, rank]
    return weights / (total[:, None] + 1e-20), chosen


def test_negative_control_batch_dependent_reduction_breaks_invariance():
    pairs = _alone_and_in_batches(_batch_dependent_routing, "cpu")
    assert any(not torch.equal(w_batch, w_alone) for (w_alone, _), (w_batch, _), _ in pairs)


def test_nan_logits_still_name_distinct_experts_in_range():
    """A NaN in a row (a broken model) must not index past the experts downstream; padding
    columns (60 experts in blocks of 4 x 32) are never picked."""
    logits, bias = _inputs(3, 60, seed=8)
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    _, chosen = moe_group_routing(logits, bias, 8, 3, 1, True)
    assert bool(((chosen >= 0) & (chosen < 60)).all())
    assert all(len(set(row)) == 8 for row in chosen.tolist())
    assert 3 in chosen[1].tolist()  # NaN ranks first, as in torch.topk


def test_rejects_bad_arguments():
    logits, bias = torch.randn(4, 8), torch.zeros(8)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="top_k must be"):
            moe_group_routing(logits, bias, bad, 1, 1, True)
    with pytest.raises(ValueError, match="top_k must be at most"):
        moe_group_routing(logits, bias, 5, 2, 1, True)  # one kept group of 4
    with pytest.raises(ValueError, match="groups of at least 2"):
        moe_group_routing(logits, bias, 2, 3, 1, True)
    with pytest.raises(ValueError, match="groups of at least 2"):
        moe_group_routing(logits, bias, 2, 8, 1, True)
    with pytest.raises(ValueError, match="exceeds n_group"):
        moe_group_routing(logits, bias, 2, 2, 3, True)
    with pytest.raises(ValueError, match="correction bias must be"):
        moe_group_routing(logits, torch.zeros(7), 2, 1, 1, True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        moe_group_routing(logits[0], bias, 2, 1, 1, True)
    with pytest.raises(TypeError, match="dtype"):
        moe_group_routing(logits.double(), bias, 2, 1, 1, True)
    with pytest.raises(RuntimeError, match="no backward"):
        moe_group_routing(logits.requires_grad_(), bias, 2, 1, 1, True)
    weights, chosen = moe_group_routing(torch.empty(0, 8), bias, 2, 1, 1, True)
    assert weights.shape == (0, 2) and chosen.shape == (0, 2)


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("arch", [90, 89, 80])
def test_compiles_for_cuda(arch):
    for experts, top_k, n_group, topk_group in ROUTERS:
        for normalize in (True, False):
            compile_for(routing_mod._moe_group_routing_kernel, arch,
                        {"ptr": "*fp32", "experts_ptr": "*i64", "scaling": "fp32"},
                        dict(N_GROUP=n_group, GROUP_SIZE=experts // n_group, TOP_K=top_k, TOPK_GROUP=topk_group,
                             NORMALIZE=normalize, BLOCK_ROWS=1, BLOCK_G=triton.next_power_of_2(n_group),
                             BLOCK_GS=triton.next_power_of_2(experts // n_group),
                             BLOCK_K=triton.next_power_of_2(top_k)))


@pytest.mark.gpu
def test_gpu_deepseek_v3_router():
    """2048 tokens, 256 experts in 8 groups (4 kept), top-8 on a GPU: float64 agreement on the clear
    rows, rows alone equal to rows in the batch."""
    logits, bias = _inputs(2048, 256, seed=9)
    weights, chosen = moe_group_routing(logits.cuda(), bias.cuda(), 8, 8, 4, True, 2.5)
    ref_weights, ref_index, clear = _reference(logits, bias, 8, 8, 4, True, 2.5)
    assert clear.sum() > 1024 and torch.equal(chosen.cpu()[clear], ref_index[clear])
    assert (weights.cpu().double()[clear] - ref_weights[clear]).abs().max().item() < 1e-5
    for r in (0, 1023, 2047):
        alone = moe_group_routing(logits[r:r + 1].cuda(), bias.cuda(), 8, 8, 4, True, 2.5)
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], chosen[r])
