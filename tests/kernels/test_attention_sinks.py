"""Attention sinks (one learned logit per query head in the softmax denominator, gpt-oss) in the
padded, paged and autograd kernels: accuracy against float64 (leaving the sinks out fails it),
each row alone == in any padded batch, decode == prefill, paged == padded, gradients of q, k, v
and the sinks against float64. Negative control: blocks anchored at the padded row's index 0."""
import math

import pytest
import torch

from helpers.models import DTYPES
from invariant_infer.kernels import attention, attention_autograd, attention_config, paged_attention
from test_attention_window import HKV, HQ, WINDOW, D, paged_caches, qkv

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-6}


def _sinks(dtype, seed=9):
    # Large enough that a sink takes a good share of a row's weight: leaving it out is visible.
    return (2.0 + torch.randn(HQ, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _run(q, k, v, starts, ends, sinks, window=0, q_start=None):
    if q_start is None:
        q_start = torch.full_like(starts, k.shape[2] - q.shape[2])
    return attention(q, k, v, starts, ends, q_start, D ** -0.5, window=window, sinks=sinks)


def _reference(q, k, v, starts, ends, sinks, window=0):
    """float64 softmax over [scores, sink] per row, the sink's share dropped (as transformers' eager)."""
    B, _, L, _ = q.shape
    kr, vr = (t.double().repeat_interleave(HQ // HKV, 1) for t in (k, v))
    s = q.double() @ kr.transpose(-1, -2) * D ** -0.5
    i = torch.arange(L)
    visible = ((i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) | (window == 0)))[None, None] & \
        (i[None, None, None, :] >= starts.long()[:, None, None, None]) & \
        (i[None, None, None, :] < ends.long()[:, None, None, None])
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(B, HQ, L, 1)], dim=-1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :L]
    return (p @ vr).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, WINDOW])
def test_sinks_accuracy_and_leaving_them_out_is_caught(dtype, window):
    q, k, v, starts, ends = qkv([150, 9, 70], 150, dtype)
    sinks = _sinks(dtype)
    out = _run(q, k, v, starts, ends, sinks, window)
    real = torch.arange(150)[None, :] >= starts[:, None]
    error = lambda s: (out.double() - _reference(q, k, v, starts, ends, s, window)).abs()[real].max().item()  # noqa: E731
    assert error(sinks) < TOLERANCE[dtype]
    assert error(None) > 10 * TOLERANCE[dtype]
    assert error(sinks + 0.25) > 2 * TOLERANCE[dtype]
    assert torch.equal(out[1, :141], torch.zeros_like(out[1, :141]))  # left pads: 0, never NaN


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_row_alone_equals_row_in_any_padded_batch(dtype):
    n = 140
    sinks = _sinks(torch.float32)  # a float32 parameter with a bf16/fp16 model is accepted as is
    q, k, v, s0, e0 = qkv([n], n, dtype, seed=1)
    for window in (0, WINDOW):
        alone = _run(q, k, v, s0, e0, sinks, window)[0]
        for total, others, left in [(n + 13, [3, n + 13], True), (n + 64, [1], True), (n + 29, [n + 29, 2], False)]:
            qb, kb, vb, sb, eb = qkv(others + [n], total, dtype, seed=2, left=left)
            sl = slice(total - n, total) if left else slice(0, n)
            qb[-1, :, sl], kb[-1, :, sl], vb[-1, :, sl] = q[0], k[0], v[0]
            assert torch.equal(_run(qb, kb, vb, sb, eb, sinks, window)[-1, sl], alone), (total, left, window)


def test_negative_control_blocks_anchored_at_the_padded_index_0():
    n, pads = 140, 29
    sinks = _sinks(torch.bfloat16)
    q, k, v, s0, e0 = qkv([n], n, torch.bfloat16, seed=1)
    alone = _run(q, k, v, s0, e0, sinks)[0]
    qb, kb, vb, sb, eb = qkv([n], n + pads, torch.bfloat16, seed=2)
    qb[0, :, pads:], kb[0, :, pads:], vb[0, :, pads:] = q[0], k[0], v[0]
    kb[0, :, :pads] = -1e4  # pads no query may weigh
    assert torch.equal(_run(qb, kb, vb, sb, eb, sinks)[0, pads:], alone)
    assert not torch.equal(_run(qb, kb, vb, torch.zeros_like(sb), eb, sinks)[0, pads:], alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_decode_equals_prefill(dtype):
    """Decode steps (one query over the keys so far) and a chunk of 5 queries give the prefill's bits."""
    pads, n = 13, 150
    sinks = _sinks(dtype)
    q, k, v, starts, ends = qkv([n], pads + n, dtype, seed=3)
    prefill = _run(q, k, v, starts, ends, sinks)[0]
    for step in (pads, pads + 70, pads + n - 1):
        out = _run(q[:, :, step:step + 1], k[:, :, :step + 1], v[:, :, :step + 1], starts,
                   ends.clamp(max=step + 1), sinks)
        assert torch.equal(out[0, 0], prefill[step]), step
    chunk = slice(pads + 90, pads + 95)
    out = _run(q[:, :, chunk], k[:, :, :chunk.stop], v[:, :, :chunk.stop], starts,
               torch.tensor([chunk.stop], dtype=torch.int32), sinks)
    assert torch.equal(out[0], prefill[chunk])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_sinks_equal_padded_sinks(dtype):
    page = attention_config("cpu", dtype, D).block_n
    lengths = (150, 40)
    sinks = _sinks(dtype)
    q, k, v, starts, ends = qkv([150], 150, dtype, seed=4)
    q2, k2, v2, s2, e2 = qkv([40], 40, dtype, seed=5)
    for window in (0, WINDOW):
        padded = [_run(q, k, v, starts, ends, sinks, window)[0], _run(q2, k2, v2, s2, e2, sinks, window)[0]]
        k_cache, v_cache, tables = paged_caches([(k, v), (k2, v2)], page)
        queries = torch.cat([q[0, :, 120:150].transpose(0, 1), q2[0, :, 39:40].transpose(0, 1)])
        out = paged_attention(queries, k_cache, v_cache, torch.tensor([0, 30, 31], dtype=torch.int32),
                              torch.tensor(lengths, dtype=torch.int32), tables, D ** -0.5, max_query_len=30,
                              window=window, sinks=sinks)
        assert torch.equal(out[:30], padded[0][120:150]) and torch.equal(out[30], padded[1][39]), window


def test_autograd_sinks_forward_bits_and_gradients_against_float64():
    q, k, v, starts, ends = qkv([100, 37], 100, torch.float32, seed=6)
    sinks = _sinks(torch.float32)
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    q_start = torch.zeros_like(starts)
    out = attention_autograd(q, k, v, starts, ends, q_start, D ** -0.5, window=WINDOW, sinks=sinks)
    assert torch.equal(out.detach(), _run(q.detach(), k.detach(), v.detach(), starts, ends, sinks.detach(), WINDOW))
    grad = torch.randn_like(out)
    real = (torch.arange(100)[None, :] >= starts[:, None])[..., None, None].to(grad.dtype)
    (out * grad * real).sum().backward()
    q64, k64, v64, sinks64 = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    ref = _reference(q64, k64, v64, starts, ends, sinks64, WINDOW)
    (ref * grad.double() * real.double()).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad), (sinks.grad, sinks64.grad)):
        assert (got.double() - want).abs().max().item() < 1e-5
    assert sinks64.grad.abs().min().item() > 1e-3  # the sinks' gradient is not trivially 0
