"""Mixture-of-experts routing per token: softmax over the experts, top-k, optional renormalisation.

Each row of router logits [T, E] is reduced on its own, in one block of all E experts (the block
width is fixed by E alone), so a token's routing has the same bits whatever tokens share its
launch. In fp32: p = exp(l - max l) / sum(exp(l - max l)) (IEEE division), then k rounds of
"take the largest p, the lowest expert index among equal ones", so the experts come in
descending probability with ties broken by the lowest index (as ``torch.topk`` is documented
not to promise). With ``normalize`` the k weights are divided by their sum, added in rank order
(Qwen3-MoE's ``norm_topk_prob``; Mixtral always normalises).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, reduction_rows
from .configs import tile_device
from .errors import InvalidArgumentError, InvalidDtypeError, UnsupportedOperationError

MAX_TOP_K = 16


@triton.jit(do_not_specialize=["R"])
def _moe_routing_kernel(logits_ptr, weights_ptr, experts_ptr, R, E, stride_r,
                        TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    rows = tl.minimum(rows, R - 1)  # tail rows re-read the last row (never stored)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + rows[:, None] * stride_r + cols[None, :], mask=cols[None, :] < E,
                other=float("-inf")).to(tl.float32)
    num = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.math.div_rn(num, tl.sum(num, axis=1)[:, None])
    # The selection key: padding columns are never picked; NaN ranks above every probability (as
    # in torch.topk), so a NaN row still names E distinct experts in range.
    key = tl.where(cols[None, :] < E, tl.where(p == p, p, 2.0), -1.0)
    ranks = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_ROWS, BLOCK_K), tl.float32)
    experts = tl.zeros((BLOCK_ROWS, BLOCK_K), tl.int32)
    total = tl.zeros((BLOCK_ROWS,), tl.float32)
    for rank in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        pick = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)  # lowest index of the max
        picked = cols[None, :] == pick[:, None]
        weight = tl.sum(tl.where(picked, p, 0.0), axis=1)  # p itself: every other term is +0.0
        weights = tl.where(ranks[None, :] == rank, weight[:, None], weights)
        experts = tl.where(ranks[None, :] == rank, pick[:, None], experts)
        total += weight  # in rank order
        key = tl.where(picked, -1.0, key)
    if NORMALIZE:
        weights = tl.math.div_rn(weights, total[:, None])
    out = rows[:, None] * TOP_K + ranks[None, :]
    mask = row_ok[:, None] & (ranks[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(experts_ptr + out, experts.to(tl.int64), mask=mask)


def moe_routing(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], experts int64 [T, top_k]) for router logits [T, E] (bf16, fp16 or
    fp32): per row, the top_k experts by softmax probability (fp32), in descending order, ties to
    the lowest expert index; with ``normalize`` the weights are divided by their sum."""
    if router_logits.dim() != 2:
        raise InvalidArgumentError(f"moe_routing: expected router logits [T, E], got {tuple(router_logits.shape)}")
    if router_logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidDtypeError(f"moe_routing: router logits dtype {router_logits.dtype} is not bf16, fp16 or fp32")
    t, e = router_logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(e, MAX_TOP_K):
        raise InvalidArgumentError(f"moe_routing: top_k must be an int in [1, min(E, {MAX_TOP_K})] = [1, "
                                   f"{min(e, MAX_TOP_K)}], got {top_k!r}")
    if router_logits.requires_grad and torch.is_grad_enabled():
        raise UnsupportedOperationError("moe_routing has no backward: call it under torch.no_grad() or "
                                        "torch.inference_mode() (training mixture-of-experts layers is not supported)")
    weights = torch.empty((t, top_k), device=router_logits.device, dtype=torch.float32)
    experts = torch.empty((t, top_k), device=router_logits.device, dtype=torch.int64)
    if t == 0:
        return weights, experts
    logits = reduction_rows(router_logits)
    # The interpreter pays per program, so it takes 16 rows at a time; on GPU one row per program.
    block_rows = 16 if tile_device(logits.device.type) == "cpu" else 1
    block_e = triton.next_power_of_2(e)
    launch(_moe_routing_kernel, (triton.cdiv(t, block_rows),), logits.device,
           logits, weights, experts, t, e, logits.stride(0),
           TOP_K=top_k, NORMALIZE=bool(normalize), BLOCK_ROWS=block_rows, BLOCK_E=block_e,
           BLOCK_K=triton.next_power_of_2(top_k), num_warps=4 if block_e <= 1024 else 8)
    return weights, experts
