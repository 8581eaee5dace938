"""Autograd through the invariant attention: the forward's bits, gradients against float64, the
same batch gives the same bits twice, pads get exactly zero, and a sample's dQ / dK / dV are
bitwise the same alone and in any padded batch.

No gradcheck: the kernels support bf16 / fp16 / fp32 only, not float64."""
import math
import sys

import pytest
import torch

from helpers.kernel_compile import compile_for
from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import (AttentionBackwardConfig, AttentionConfig, attention, attention_autograd,
                                     attention_backward_config, attention_config)

autograd_mod = sys.modules["invariant_infer.kernels.attention_autograd"]
attention_mod = sys.modules["invariant_infer.kernels.attention"]
launch_mod = sys.modules["invariant_infer.kernels.launch"]

# Max |error| / max |float64 gradient| on the same rounded inputs. P and dS are rounded to the
# dtype before their products (as FlashAttention-2 does), everything else accumulates in fp32.
# Measured on CPU at 500 tokens, head_dim 128: bf16 4e-3, fp16 5e-4, fp32 1e-6.
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 5e-6}
HQ, HKV = 4, 2  # GQA: two query heads per KV head


def padded_batch(lengths, total, dtype, device, d=32, left=True, seed=0, hq=HQ, hkv=HKV):
    """q, k, v, dO and the row bounds of a batch: row b holds lengths[b] tokens padded to `total`.
    ``left`` may be a list (one side per row). dO is random everywhere, pads included."""
    g = torch.Generator().manual_seed(seed)
    sides = left if isinstance(left, list) else [left] * len(lengths)
    B = len(lengths)
    q, do = torch.randn(B, hq, total, d, generator=g), torch.randn(B, total, hq, d, generator=g)
    k, v = torch.randn(B, hkv, total, d, generator=g), torch.randn(B, hkv, total, d, generator=g)
    starts = torch.tensor([total - n if side else 0 for n, side in zip(lengths, sides)], dtype=torch.int32)
    ends = starts + torch.tensor(lengths, dtype=torch.int32)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(do), starts.to(device), ends.to(device)


def kernel_grads(q, k, v, do, starts, ends, q_start=None, **configs):
    """(out, dQ, dK, dV) through attention_autograd; training layout (q_start 0) by default."""
    q_start = torch.zeros_like(starts) if q_start is None else q_start
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention_autograd(*leaves, starts, ends, q_start, q.shape[-1] ** -0.5, **configs)
    out.backward(do)
    return (out.detach(), *(t.grad for t in leaves))


def reference(q, k, v, starts, ends, q_start):
    """Causal GQA attention in float64; the outputs of pad queries (positions outside
    [start, end)) are zeroed, as the kernel's backward treats them as constants."""
    B, hq, Lq, d = q.shape
    group, Lk = hq // k.shape[1], k.shape[2]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * d ** -0.5
    pos = q_start.long()[:, None] + torch.arange(Lq, device=q.device)  # [B, Lq]
    key = torch.arange(Lk, device=q.device)
    lo, hi = starts.long()[:, None, None], ends.long()[:, None, None]
    visible = (key <= pos[:, :, None]) & (key >= lo) & (key < hi)  # [B, Lq, Lk]
    p = torch.softmax(s.masked_fill(~visible[:, None], -math.inf), -1).nan_to_num(0.0)
    real = (pos >= starts.long()[:, None]) & (pos < ends.long()[:, None])
    return (p @ v.repeat_interleave(group, 1)).transpose(1, 2) * real[:, :, None, None]


def assert_close_to_float64(q, k, v, do, starts, ends, q_start=None):
    q_start = torch.zeros_like(starts) if q_start is None else q_start
    out, *grads = kernel_grads(q, k, v, do, starts, ends, q_start)
    assert torch.equal(out, attention(q, k, v, starts, ends, q_start, q.shape[-1] ** -0.5)), "the inference bits"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, starts, ends, q_start).backward(do.double())
    for name, got, want in zip("qkv", grads, (t.grad for t in leaves)):
        assert got.dtype == q.dtype and got.shape == want.shape, name
        error = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert error < TOLERANCE[q.dtype], f"d{name}: {error}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64_with_gqa_and_padding(dtype, device):
    assert_close_to_float64(*padded_batch([40, 7, 23], 40, dtype, device, left=[True, True, False]))


@pytest.mark.parametrize("d", [64, 40], ids=["head_dim_64", "head_dim_40"])
def test_gradients_match_float64_at_other_head_dims(d):
    assert_close_to_float64(*padded_batch([21, 9], 21, torch.bfloat16, "cpu", d=d, left=[True, False]))


def test_gradients_of_a_chunk_after_cached_keys_match_float64():
    """Queries at q_start > 0 over a longer key buffer (a KV cache): the gradient of this call."""
    q, k, v, do, starts, ends = padded_batch([30, 12], 30, torch.float32, "cpu", seed=3)
    q_start = torch.tensor([22, 22], dtype=torch.int32)
    assert_close_to_float64(q[:, :, 22:], k, v, do[:, 22:], starts, ends, q_start)


def test_pads_get_zero_gradient_and_contribute_nothing():
    """Random dO on pad queries too: they change no gradient, and pads' own gradients are 0."""
    q, k, v, do, starts, ends = padded_batch([9, 30, 17, 0], 30, torch.bfloat16, "cpu", left=[True, False, False, True])
    _, dq, dk, dv = kernel_grads(q, k, v, do, starts, ends)
    pos = torch.arange(30)
    pad = (pos[None, :] < starts[:, None]) | (pos[None, :] >= ends[:, None])  # [B, L]
    assert pad.sum() > 0 and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    for grad in (dq, dk, dv):
        assert (grad.transpose(1, 2)[pad] == 0).all()
    quiet = do.clone()
    quiet[pad] = 0
    assert all(torch.equal(a, b) for a, b in zip(kernel_grads(q, k, v, quiet, starts, ends)[1:], (dq, dk, dv)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_batch_gives_the_same_bits_twice(dtype, device):
    batch = padded_batch([33, 12], 33, dtype, device, left=[True, False])
    assert all(torch.equal(a, b) for a, b in zip(kernel_grads(*batch), kernel_grads(*batch)))


def test_layout_of_the_operands_never_changes_the_bits():
    """q as the model passes it (a transposed view of [B, L, H, D]) and a strided dO: same bits."""
    q, k, v, do, starts, ends = padded_batch([20, 13], 20, torch.float16, "cpu")
    strided = kernel_grads(q.transpose(1, 2).contiguous().transpose(1, 2), k, v,
                           do.transpose(0, 1).contiguous().transpose(0, 1), starts, ends)
    assert all(torch.equal(a, b) for a, b in zip(kernel_grads(q, k, v, do, starts, ends), strided))


def test_gradient_of_some_inputs_only_and_double_backward_refused():
    q, k, v, do, starts, ends = padded_batch([12, 5], 12, torch.float32, "cpu")
    full = kernel_grads(q, k, v, do, starts, ends)
    for wanted in ((0,), (1, 2), (2,)):
        leaves = [t.detach().requires_grad_(i in wanted) for i, t in enumerate((q, k, v))]
        out = attention_autograd(*leaves, starts, ends, torch.zeros_like(starts), 32 ** -0.5)
        grads = torch.autograd.grad(out, [leaves[i] for i in wanted], do)
        assert all(torch.equal(g, full[1 + i]) for g, i in zip(grads, wanted)), wanted
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention_autograd(*leaves, starts, ends, torch.zeros_like(starts), 32 ** -0.5)
    (dq,) = torch.autograd.grad(out, leaves[0], do.clone().requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        dq.sum().backward()


N = 70  # two KV blocks of 64 and three query tiles of 32 on CPU
BATCHES = [  # (total, other rows' lengths, side of the sample's padding)
    (N, [N, 5], True), (N + 13, [3, N + 13], True), (N + 29, [N + 29, 2], False), (N + 6, [11], False), (N, [], True),
]


def batch_mismatches(dtype, configs_for=lambda B: {}):
    """The batches in which the sample's (out, dQ, dK, dV) differ from the sample alone.
    ``configs_for(B)``: the configs a batch of B rows runs with (default: the fixed ones)."""
    q, k, v, do, s0, e0 = padded_batch([N], N, dtype, "cpu", seed=1)
    alone = kernel_grads(q, k, v, do, s0, e0, **configs_for(1))
    found = []
    for total, others, left in BATCHES:
        qb, kb, vb, dob, sb, eb = padded_batch(others + [N], total, dtype, "cpu", left=left, seed=2)
        sl, last = (slice(total - N, total) if left else slice(0, N)), len(others)
        qb[last, :, sl], kb[last, :, sl], vb[last, :, sl], dob[last, sl] = q[0], k[0], v[0], do[0]
        out, dq, dk, dv = kernel_grads(qb, kb, vb, dob, sb, eb, **configs_for(len(others) + 1))
        sample = (out[last, sl], dq[last, :, sl], dk[last, :, sl], dv[last, :, sl])
        if not all(torch.equal(a, b[0]) for a, b in zip(sample, alone)):
            found.append((total, others, left))
    return found


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_of_a_sample_alone_equal_it_in_any_padded_batch(dtype):
    assert batch_mismatches(dtype) == []


@pytest.mark.heavy
def test_negative_control_batch_dependent_query_tile_breaks_invariance():
    """dK/dV with a query tile picked by the batch size: a key's sum is regrouped, dK changes."""
    base = attention_backward_config("cpu", torch.float32, 32)

    def configs_for(B):
        return dict(backward_config=AttentionBackwardConfig(block_m=base.block_m if B == 1 else base.block_m // 2,
                                                            block_n=base.block_n))

    assert batch_mismatches(torch.float32, configs_for) == [batch for batch in BATCHES if batch[1]]


@pytest.mark.heavy
def test_negative_control_query_tiles_from_row_0_break_invariance_under_left_padding():
    """dK/dV with query tiles starting at row 0 instead of the first real query: a left pad that is
    not a multiple of the tile moves the tile boundaries over the sample's queries."""
    unaligned = dict(backward_config=AttentionBackwardConfig(
        **{**vars(attention_backward_config("cpu", torch.float32, 32)), "tiles_from_kv_start": False}))
    tile = unaligned["backward_config"].block_m
    shifted = [batch for batch in BATCHES if batch[2] and (batch[0] - N) % tile]
    assert shifted and batch_mismatches(torch.float32, lambda B: unaligned) == shifted


def test_negative_control_batch_dependent_kv_block_breaks_invariance():
    """dQ (and the forward) with a KV block picked by the batch size: the key sums are regrouped."""
    base = attention_config("cpu", torch.float32, 32)

    def configs_for(B):
        return dict(config=AttentionConfig(block_m=base.block_m, block_n=base.block_n if B == 1 else base.block_n // 2))

    assert batch_mismatches(torch.float32, configs_for) == [batch for batch in BATCHES if batch[1]]


def test_bad_shapes_and_dtypes_are_refused():
    q, k, v, _, starts, ends = padded_batch([8], 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="incompatible"):
        attention_autograd(q, k[:, :, :4], v, starts, ends, starts, 0.1)
    with pytest.raises(TypeError, match="dtypes differ"):
        attention_autograd(q, k.half(), v, starts, ends, starts, 0.1)


TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
SHARED_MEMORY_LIMIT = 99 * 1024  # sm_89's opt-in maximum per block (sm_80: 163 KiB)


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("arch, dtype", [(90, torch.bfloat16), (89, torch.bfloat16), (80, torch.bfloat16),
                                         (89, torch.float16), (89, torch.float32)], ids=str)
def test_backward_kernels_compile_for_cuda_within_shared_memory(arch, dtype):
    """Offline (no GPU needed): the LSE-storing forward and the backward kernels at head_dim 128
    (the largest footprint the configs serve), with the CUDA launch's blocks and pinned options.
    Every arch for bf16; fp16 and fp32 on sm_89, the smallest shared memory (each compile takes
    seconds on CPU)."""
    d = 128
    cfg, bwd = attention_config("cuda", dtype, d), attention_backward_config("cuda", dtype, d)
    types = {"ptr": f"*{TL_DTYPE[dtype]}", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "kv_start_ptr": "*i32",
             "kv_end_ptr": "*i32", "q_start_ptr": "*i32", "scale": "fp32"}
    common = dict(GROUP=6, BLOCK_D=d, DOT_PRECISION=launch_mod.DOT_PRECISION)
    kernels = [
        (attention_mod._attention_kernel, dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STORE_LSE=True), cfg),
        (autograd_mod._attention_bwd_dkdv_kernel, dict(common, BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n,
                                                       TILES_FROM_KV_START=True), bwd),
        (autograd_mod._attention_bwd_dq_kernel, dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n), bwd),
    ]
    for kernel, constexprs, launch_cfg in kernels:
        compiled = compile_for(kernel, arch, types, constexprs, launch_cfg.num_warps, launch_cfg.num_stages)
        assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, (kernel.fn.__name__, compiled.metadata.shared)
    compile_for(autograd_mod._attention_bwd_delta_kernel, arch, types,
                dict(BLOCK_ROWS=bwd.delta_rows, BLOCK_D=d), bwd.num_warps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_realistic_shape_on_cuda_matches_float64_and_is_invariant(dtype):
    """12 query heads of 128, 2 KV heads; a sample alone vs in a left- and a right-padded batch."""
    n, d = 300, 128
    batch = padded_batch([n, 77, 512], 512, dtype, "cuda", d=d, left=[True, False, True], hq=12, hkv=2)
    assert_close_to_float64(*batch)
    q, k, v, do, starts, ends = batch
    sample = [q[:1, :, -n:], k[:1, :, -n:], v[:1, :, -n:], do[:1, -n:]]  # row 0: n tokens, left-padded
    alone = kernel_grads(*sample, torch.zeros(1, dtype=torch.int32, device="cuda"),
                         torch.full((1,), n, dtype=torch.int32, device="cuda"))
    for left in (True, False):
        qb, kb, vb, dob, sb, eb = padded_batch([200, n], 400, dtype, "cuda", d=d, left=left, seed=5, hq=12, hkv=2)
        sl = slice(400 - n, 400) if left else slice(0, n)
        qb[1, :, sl], kb[1, :, sl], vb[1, :, sl], dob[1, sl] = (t[0] for t in sample)
        out, dq, dk, dv = kernel_grads(qb, kb, vb, dob, sb, eb)
        got = (out[1, sl], dq[1, :, sl], dk[1, :, sl], dv[1, :, sl])
        assert all(torch.equal(a, b[0]) for a, b in zip(got, alone)), f"left={left}"
