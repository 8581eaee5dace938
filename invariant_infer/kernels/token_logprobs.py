"""Batch-invariant token logprobs: log_softmax(logits / T)[target] and "is target the argmax", per row.

Each row [V] is reduced on its own: the vocabulary is walked in blocks of BLOCK_V (fixed by
device and V alone, never by the number of rows), in order, with an online max and sum of
exponentials in fp32. So a row's logprob has the same bits whatever rows share its launch,
and only [rows x V] logits in the input dtype need exist; nothing is upcast to a full fp32 copy.

The temperature T divides each logit after its fp32 upcast, as the sampler's ``scores.float() /
temperature`` (IEEE division, bitwise torch's on CPU; torch on CUDA multiplies by the reciprocal,
within an ulp of it). At T = 1 the division is exact: the bits are those of no temperature.
Argmax ties break to the first (lowest) index, as torch.argmax does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, reduction_rows
from .configs import tile_device
from .errors import InvalidArgumentError, InvalidDtypeError


@triton.jit(do_not_specialize=["R"])
def _token_logprobs_kernel(logits_ptr, targets_ptr, logprob_ptr, argmax_ptr, lse_ptr, R, V, stride_r, temperature,
                           BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr, STORE_LSE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    rows = tl.minimum(rows, R - 1)  # tail rows re-read the last row (never stored): no all -inf rows
    cols = tl.arange(0, BLOCK_V)
    run_max = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_ROWS,), tl.float32)
    best = tl.zeros((BLOCK_ROWS,), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        x = tl.load(logits_ptr + rows[:, None] * stride_r + idx[None, :], mask=idx[None, :] < V,
                    other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(x, temperature)
        block_max = tl.max(x, axis=1)
        # First index of the block's max; a later block wins only if strictly greater.
        block_best = tl.min(tl.where(x == block_max[:, None], idx[None, :], V), axis=1)
        best = tl.where(block_max > run_max, block_best, best)
        new_max = tl.maximum(run_max, block_max)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
        run_max = new_max
    targets = tl.load(targets_ptr + rows)
    target_logit = tl.math.div_rn(tl.load(logits_ptr + rows * stride_r + targets).to(tl.float32), temperature)
    lse = run_max + tl.log(run_sum)
    tl.store(logprob_ptr + rows, target_logit - lse, mask=row_ok)
    tl.store(argmax_ptr + rows, best, mask=row_ok)
    if STORE_LSE:  # for the backward's softmax; the inference launch stores nothing more
        tl.store(lse_ptr + rows, lse, mask=row_ok)


def vocab_block(device_type: str, vocab_size: int) -> int:
    """The one block width used over the vocabulary for this device and V, whatever the rows."""
    cap = 8192 if tile_device(device_type) == "cpu" else 2048  # the interpreter pays per loop step, the GPU per register
    return min(cap, triton.next_power_of_2(vocab_size))


def check_temperature(temperature) -> float:
    """``temperature`` as a float, or a ValueError when it is not a finite number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise InvalidArgumentError(f"token_logprobs: temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def launch_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, store_lse: bool,
                          block_v: int | None = None):
    """(logprobs fp32 [R], argmax int32 [R], lse fp32 [R] or None, the rows as reduced, int64 targets).
    ``block_v`` replaces the vocabulary block width (tests only: a width that is not V's alone)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise InvalidArgumentError("token_logprobs: expected logits [R, V] and targets [R], got "
                                   f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidDtypeError(f"token_logprobs: logits dtype {logits.dtype} is not bf16, fp16 or fp32")
    temperature = check_temperature(temperature)
    r, v = logits.shape
    logprobs = torch.empty(r, device=logits.device, dtype=torch.float32)
    argmax = torch.empty(r, device=logits.device, dtype=torch.int32)
    lse = torch.empty(r, device=logits.device, dtype=torch.float32) if store_lse else None
    targets = targets.to(device=logits.device, dtype=torch.int64).contiguous()
    if r == 0:
        return logprobs, argmax, lse, logits, targets
    logits = reduction_rows(logits)
    if not logits.is_cuda and bool(((targets < 0) | (targets >= v)).any()):  # GPU: no host sync
        raise InvalidArgumentError(f"token_logprobs: targets must lie in [0, {v})")
    # The interpreter pays per program, so it takes 16 rows at a time; on GPU one row per program.
    block_rows = 16 if tile_device(logits.device.type) == "cpu" else 1
    block_v = block_v or vocab_block(logits.device.type, v)
    launch(_token_logprobs_kernel, (triton.cdiv(r, block_rows),), logits.device,
           logits, targets, logprobs, argmax, logprobs if lse is None else lse, r, v, logits.stride(0), temperature,
           BLOCK_ROWS=block_rows, BLOCK_V=block_v, STORE_LSE=store_lse, num_warps=4 if block_v <= 1024 else 8)
    return logprobs, argmax, lse, logits, targets


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits [R, V] (bf16, fp16 or fp32) and int targets [R] in [0, V):
    returns (fp32 [R] log_softmax(logits / temperature)[r, targets[r]],
    bool [R] targets[r] == first argmax of row r). ``temperature`` must be > 0.

    Targets out of range raise on CPU; on CUDA they are not checked (that would sync the host)."""
    logprobs, argmax, _, _, targets = launch_token_logprobs(logits, targets, temperature, store_lse=False)
    return logprobs, argmax.to(torch.int64) == targets
