"""Group-limited sigmoid routing with a selection bias (DeepSeek-V3, GLM-4.5), per token.

For router logits l [T, E] and a bias b [E] (``e_score_correction_bias``), with the E experts in
``n_group`` consecutive groups of E / n_group:
  s = sigmoid(l) = 1 / (1 + exp(-l)) in fp32 (IEEE division); c = s + b, the selection score;
  a group's score is the sum of its two largest c; the ``topk_group`` best groups are kept;
  the ``top_k`` experts of largest c among the kept groups are chosen, in descending c;
  their weights are s (the bias selects, it does not weigh), with ``normalize`` divided by
  (sum + 1e-20), the sum taken in rank order, then multiplied by ``scaling``.
Every comparison breaks exact ties to the lowest index (expert, and group). Each row is reduced
on its own in one [groups, experts per group] block fixed by E and n_group alone, so a token's
routing has the same bits whatever tokens share its launch. The sigmoid is computed here, per
row, not by torch: torch's elementwise fp32 sigmoid on CPU rounds differently in its vectorized
body and in its scalar tail, and where a token lands in a tensor depends on the batch.
NaN (a broken model) ranks above every score, as in torch.topk, so a NaN row still names
top_k distinct experts in range; padding columns are never picked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import tile_device
from .errors import InvalidArgumentError, InvalidDtypeError, UnsupportedOperationError
from .launch import launch, reduction_rows
from .moe_routing import MAX_TOP_K


@triton.jit
def _nan_high(x):
    return tl.where(x == x, x, float("inf"))


@triton.jit(do_not_specialize=["R"])
def _moe_group_routing_kernel(logits_ptr, bias_ptr, weights_ptr, experts_ptr, R, stride_r, scaling,
                              N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOP_K: tl.constexpr,
                              TOPK_GROUP: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    rows = tl.minimum(rows, R - 1)  # tail rows re-read the last row (never stored)
    groups = tl.arange(0, BLOCK_G)
    members = tl.arange(0, BLOCK_GS)
    expert = groups[:, None] * GROUP_SIZE + members[None, :]                       # [G, GS]
    valid = (groups[:, None] < N_GROUP) & (members[None, :] < GROUP_SIZE)
    no_index = BLOCK_G * BLOCK_GS
    x = tl.load(logits_ptr + rows[:, None, None] * stride_r + expert[None, :, :], mask=valid[None, :, :],
                other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-x))
    key = _nan_high(s + b[None, :, :])                                              # [R, G, GS]
    valid3 = (tl.zeros((BLOCK_ROWS, BLOCK_G, BLOCK_GS), tl.int32) == 0) & valid[None, :, :]

    # A group's score: its largest key plus its next largest (the same value again on a tie).
    top1 = tl.max(tl.where(valid3, key, float("-inf")), axis=2)
    first = tl.min(tl.where(valid3 & (key == top1[:, :, None]), members[None, None, :], BLOCK_GS), axis=2)
    top2 = tl.max(tl.where(valid3 & (members[None, None, :] != first[:, :, None]), key, float("-inf")), axis=2)
    group_key = _nan_high(top1 + top2)                                              # [R, G]
    group_free = (tl.zeros((BLOCK_ROWS, BLOCK_G), tl.int32) + groups[None, :]) < N_GROUP
    kept = tl.zeros((BLOCK_ROWS, BLOCK_G), tl.int32) != 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(tl.where(group_free, group_key, float("-inf")), axis=1)
        pick = tl.min(tl.where(group_free & (group_key == best[:, None]), groups[None, :], BLOCK_G), axis=1)
        taken = groups[None, :] == pick[:, None]
        kept = kept | taken
        group_free = group_free & ~taken

    free = valid3 & kept[:, :, None]
    ranks = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_ROWS, BLOCK_K), tl.float32)
    experts = tl.zeros((BLOCK_ROWS, BLOCK_K), tl.int32)
    total = tl.zeros((BLOCK_ROWS,), tl.float32)
    for rank in tl.static_range(TOP_K):
        best = tl.max(tl.max(tl.where(free, key, float("-inf")), axis=2), axis=1)
        candidates = tl.where(free & (key == best[:, None, None]), expert[None, :, :], no_index)
        pick = tl.min(tl.min(candidates, axis=2), axis=1)                          # lowest expert of the max
        picked = valid3 & (expert[None, :, :] == pick[:, None, None])  # padding aliases the next group's numbers
        weight = tl.sum(tl.sum(tl.where(picked, s, 0.0), axis=2), axis=1)       # s itself: other terms are +0.0
        weights = tl.where(ranks[None, :] == rank, weight[:, None], weights)
        experts = tl.where(ranks[None, :] == rank, pick[:, None], experts)
        total += weight  # in rank order
        free = free & ~picked
    if NORMALIZE:
        weights = tl.math.div_rn(weights, (total + 1e-20)[:, None])
    weights = weights * scaling
    out = rows[:, None] * TOP_K + ranks[None, :]
    mask = row_ok[:, None] & (ranks[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(experts_ptr + out, experts.to(tl.int64), mask=mask)


def moe_group_routing(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                      topk_group: int, normalize: bool, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], experts int64 [T, top_k]) for router logits [T, E] (fp32, bf16 or
    fp16) and a selection bias [E]: per row, sigmoid scores, the ``topk_group`` of ``n_group``
    groups with the largest sums of their two best (score + bias), the ``top_k`` experts of largest
    score + bias in those groups, in descending order (ties to the lowest index); weights are the
    scores, with ``normalize`` divided by (their sum + 1e-20), then times ``scaling``."""
    if router_logits.dim() != 2:
        raise InvalidArgumentError(f"moe_group_routing: expected router logits [T, E], got "
                                   f"{tuple(router_logits.shape)}")
    for name, tensor in (("router logits", router_logits), ("correction bias", correction_bias)):
        if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidDtypeError(f"moe_group_routing: {name} dtype {tensor.dtype} is not bf16, fp16 or fp32")
    t, e = router_logits.shape
    if correction_bias.shape != (e,) or correction_bias.device != router_logits.device:
        raise InvalidArgumentError(f"moe_group_routing: correction bias must be [{e}] on {router_logits.device}, "
                                   f"got {tuple(correction_bias.shape)} on {correction_bias.device}")
    for name, value in (("top_k", top_k), ("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"moe_group_routing: {name} must be a positive int, got {value!r}")
    if e % n_group or e // n_group < 2:
        raise InvalidArgumentError(f"moe_group_routing: {e} experts do not split into {n_group} groups of at "
                                   "least 2 (a group's score is the sum of its two best)")
    if topk_group > n_group:
        raise InvalidArgumentError(f"moe_group_routing: topk_group {topk_group} exceeds n_group {n_group}")
    kept = topk_group * (e // n_group)
    if top_k > min(kept, MAX_TOP_K):
        raise InvalidArgumentError(f"moe_group_routing: top_k must be at most min(experts in the kept groups, "
                                   f"{MAX_TOP_K}) = {min(kept, MAX_TOP_K)}, got {top_k}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise InvalidArgumentError(f"moe_group_routing: scaling must be a number, got {scaling!r}")
    if torch.is_grad_enabled() and (router_logits.requires_grad or correction_bias.requires_grad):
        raise UnsupportedOperationError("moe_group_routing has no backward: call it under torch.no_grad() or "
                                        "torch.inference_mode() (training mixture-of-experts layers is not "
                                        "supported)")
    weights = torch.empty((t, top_k), device=router_logits.device, dtype=torch.float32)
    experts = torch.empty((t, top_k), device=router_logits.device, dtype=torch.int64)
    if t == 0:
        return weights, experts
    logits = reduction_rows(router_logits)
    bias = correction_bias.contiguous()
    group_size = e // n_group
    # The interpreter pays per program, so it takes 16 rows at a time; on GPU one row per program.
    block_rows = 16 if tile_device(logits.device.type) == "cpu" else 1
    block_g, block_gs = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    launch(_moe_group_routing_kernel, (triton.cdiv(t, block_rows),), logits.device,
           logits, bias, weights, experts, t, logits.stride(0), float(scaling),
           N_GROUP=n_group, GROUP_SIZE=group_size, TOP_K=top_k, TOPK_GROUP=topk_group, NORMALIZE=bool(normalize),
           BLOCK_ROWS=block_rows, BLOCK_G=block_g, BLOCK_GS=block_gs, BLOCK_K=triton.next_power_of_2(top_k),
           num_warps=4 if block_g * block_gs <= 1024 else 8)
    return weights, experts
