"""Autograd through the attention in its non-causal mode (``causal=False``: bidirectional self-attention,
as encoders run it): the bits of the causal kernel run as non-causal, gradients against float64, pads
get exactly zero, and a sample's dQ / dK / dV are bitwise the same alone and in any padded batch.

No gradcheck: the kernels support bf16 / fp16 / fp32 only, not float64."""
import math
import sys

import pytest
import torch

from helpers.kernel_compile import compile_for
from invariant_infer.kernels import (AttentionBackwardConfig, attention, attention_autograd,
                                     attention_backward_config, attention_config)

autograd_mod = sys.modules["invariant_infer.kernels.attention_autograd"]
launch_mod = sys.modules["invariant_infer.kernels.launch"]

# As the causal mode's tests: max |error| / max |float64 gradient| on the same rounded inputs.
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 5e-6}
HQ, HKV, D = 4, 2, 32


def padded_batch(lengths, total, dtype, left, seed=0):
    """q, k, v, dO and the row bounds; row b holds lengths[b] tokens padded to ``total`` on the side
    ``left[b]``. dO is random everywhere, pads included."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q, do = torch.randn(B, HQ, total, D, generator=g), torch.randn(B, total, HQ, D, generator=g)
    k, v = torch.randn(B, HKV, total, D, generator=g), torch.randn(B, HKV, total, D, generator=g)
    starts = torch.tensor([total - n if side else 0 for n, side in zip(lengths, left)], dtype=torch.int32)
    ends = starts + torch.tensor(lengths, dtype=torch.int32)
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype), starts, ends


def kernel_grads(q, k, v, do, starts, ends, **configs):
    """(out, dQ, dK, dV) through attention_autograd, not causal."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention_autograd(*leaves, starts, ends, torch.zeros_like(starts), D ** -0.5, causal=False, **configs)
    out.backward(do)
    return (out.detach(), *(t.grad for t in leaves))


def reference(q, k, v, starts, ends, causal=False):
    """GQA self-attention in float64: each real query sees every real key of its row (``causal``: the
    keys up to it); pad queries' outputs zeroed, as the backward treats them as constants."""
    group, L = HQ // HKV, q.shape[2]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * D ** -0.5
    pos = torch.arange(L)
    lo, hi = starts.long()[:, None], ends.long()[:, None]
    real = (pos >= lo) & (pos < hi)  # [B, L]
    visible = real[:, None, :] & (pos[None, None, :] <= pos[None, :, None] if causal else True)
    p = torch.softmax(s.masked_fill(~visible[:, None], -math.inf), -1).nan_to_num(0.0)
    return (p @ v.repeat_interleave(group, 1)).transpose(1, 2) * real[:, :, None, None]


def float64_errors(batch, causal_reference=False):
    q, k, v, do, starts, ends = batch
    _, *grads = kernel_grads(*batch)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, starts, ends, causal_reference).backward(do.double())
    return [((got.double() - t.grad).abs().max() / t.grad.abs().max()).item() for got, t in zip(grads, leaves)]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_is_the_causal_kernel_run_as_non_causal_and_gradients_match_float64(dtype):
    batch = padded_batch([40, 7, 23], 40, dtype, left=[True, True, False])
    q, k, v, _, starts, ends = batch
    out = kernel_grads(*batch)[0]
    assert torch.equal(out, attention(q, k, v, starts, ends, torch.full_like(starts, 40), D ** -0.5))
    errors = float64_errors(batch)
    assert max(errors) < TOLERANCE[dtype], errors


def test_negative_control_the_tolerance_sees_a_causal_mask():
    """The kernel's non-causal gradients are far from the causal float64 ones (and the causal mode's
    from the non-causal ones): the float64 test sees which mask runs."""
    batch = padded_batch([40, 23], 40, torch.float32, left=[True, False])
    assert min(float64_errors(batch, causal_reference=True)[:2]) > 100 * TOLERANCE[torch.float32]


def test_pads_get_zero_gradient_and_contribute_nothing():
    q, k, v, do, starts, ends = padded_batch([9, 30, 17, 0], 30, torch.bfloat16, left=[True, False, False, True])
    _, dq, dk, dv = kernel_grads(q, k, v, do, starts, ends)
    pos = torch.arange(30)
    pad = (pos[None, :] < starts[:, None]) | (pos[None, :] >= ends[:, None])
    assert pad.sum() > 0 and all(torch.isfinite(g).all() for g in (dq, dk, dv))
    for grad in (dq, dk, dv):
        assert (grad.transpose(1, 2)[pad] == 0).all()
    quiet = do.clone()
    quiet[pad] = 0
    assert all(torch.equal(a, b) for a, b in zip(kernel_grads(q, k, v, quiet, starts, ends)[1:], (dq, dk, dv)))


N = 70  # two KV blocks of 64 and three dK/dV query tiles of 32 on CPU
BATCHES = [(N + 13, [3, N + 13], True), (N + 6, [11], False), (N, [], True)]  # (total, others, side)


def batch_mismatches(dtype, configs=None):
    """The batches in which the sample's (out, dQ, dK, dV) differ from the sample alone."""
    configs = configs or {}
    q, k, v, do, s0, e0 = padded_batch([N], N, dtype, left=[True], seed=1)
    alone = kernel_grads(q, k, v, do, s0, e0, **configs)
    found = []
    for total, others, left in BATCHES:
        qb, kb, vb, dob, sb, eb = padded_batch(others + [N], total, dtype, left=[left] * (len(others) + 1), seed=2)
        sl, last = (slice(total - N, total) if left else slice(0, N)), len(others)
        qb[last, :, sl], kb[last, :, sl], vb[last, :, sl], dob[last, sl] = q[0], k[0], v[0], do[0]
        out, dq, dk, dv = kernel_grads(qb, kb, vb, dob, sb, eb, **configs)
        sample = (out[last, sl], dq[last, :, sl], dk[last, :, sl], dv[last, :, sl])
        if not all(torch.equal(a, b[0]) for a, b in zip(sample, alone)):
            found.append((total, others, left))
    return found


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradients_of_a_sample_alone_equal_it_in_any_padded_batch(dtype):
    assert batch_mismatches(dtype) == []


def test_negative_control_query_tiles_from_row_0_break_invariance_under_left_padding():
    """dK/dV with query tiles from row 0 instead of the first real query: a left pad that is not a
    multiple of the tile moves the tile boundaries over the sample's queries."""
    unaligned = AttentionBackwardConfig(**{**vars(attention_backward_config("cpu", torch.float32, D)),
                                           "tiles_from_kv_start": False})
    shifted = [batch for batch in BATCHES if batch[2] and (batch[0] - N) % unaligned.block_m]
    assert shifted and batch_mismatches(torch.float32, dict(backward_config=unaligned)) == shifted


def test_cross_attention_and_window_are_refused_by_name():
    q, k, v, _, starts, ends = padded_batch([8], 8, torch.float32, left=[False])
    with pytest.raises(ValueError, match="causal=False"):
        attention_autograd(q[:, :, :4], k, v, starts, ends, starts, 0.1, causal=False)
    with pytest.raises(ValueError, match="causal=False"):
        attention_autograd(q, k, v, starts, ends, starts, 0.1, window=4, causal=False)


@pytest.mark.heavy
def test_non_causal_backward_kernels_compile_for_cuda_within_shared_memory():
    """Offline (no GPU needed): both backward kernels with CAUSAL=False at head_dim 128, bf16, on sm_89
    (the smallest shared memory), with the CUDA launch's blocks and pinned options."""
    d, dtype = 128, torch.bfloat16
    cfg, bwd = attention_config("cuda", dtype, d), attention_backward_config("cuda", dtype, d)
    types = {"ptr": "*bf16", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "kv_start_ptr": "*i32", "kv_end_ptr": "*i32",
             "q_start_ptr": "*i32", "scale": "fp32"}
    common = dict(GROUP=6, BLOCK_D=d, DOT_PRECISION=launch_mod.DOT_PRECISION, CAUSAL=False)
    for kernel, constexprs in ((autograd_mod._attention_bwd_dkdv_kernel,
                                dict(common, BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n, TILES_FROM_KV_START=True)),
                               (autograd_mod._attention_bwd_dq_kernel,
                                dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n))):
        compiled = compile_for(kernel, 89, types, constexprs, bwd.num_warps, bwd.num_stages)
        assert compiled.metadata.shared <= 99 * 1024, (kernel.fn.__name__, compiled.metadata.shared)
