"""Sliding-window attention (a query at p sees keys p - W + 1 .. p) in the padded, paged and
autograd kernels: accuracy against float64 (a window one key off fails it), each row alone ==
in any padded batch, decode from a cache that evicted everything before the window == prefill,
the paged kernel == the padded one. Negative control: blocks anchored at the padded row's index 0
instead of its first real token."""
import math

import pytest
import torch

from helpers.models import DTYPES
from invariant_infer.kernels import attention, attention_autograd, attention_config, paged_attention

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-6}
HQ, HKV, D = 4, 2, 32
WINDOW = 24  # shorter than the 64-key block on CPU: windows straddle block boundaries


def qkv(lengths, total, dtype, seed=0, left=True):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q, k, v = (torch.randn(B, h, total, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    starts = torch.tensor([total - n if left else 0 for n in lengths], dtype=torch.int32)
    return q, k, v, starts, starts + torch.tensor(lengths, dtype=torch.int32)


def paged_caches(sequences, page: int):
    """Each sequence's keys and values ([1, HKV, n, D] each) in pages of ``page`` slots, the
    sequences' pages back to back: (k_cache, v_cache, block tables)."""
    pages = [-(-k.shape[2] // page) for k, _ in sequences]
    k_cache = torch.zeros(sum(pages), page, HKV, D, dtype=sequences[0][0].dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(sequences), max(pages), dtype=torch.int32)
    first = 0
    for s, (k, v) in enumerate(sequences):
        for j in range(pages[s]):
            tables[s, j] = first + j
            rows = slice(j * page, min((j + 1) * page, k.shape[2]))
            k_cache[first + j, :rows.stop - rows.start] = k[0, :, rows].transpose(0, 1)
            v_cache[first + j, :rows.stop - rows.start] = v[0, :, rows].transpose(0, 1)
        first += pages[s]
    return k_cache, v_cache, tables


def _run(q, k, v, starts, ends, window=WINDOW, q_start=None):
    if q_start is None:
        q_start = torch.full_like(starts, k.shape[2] - q.shape[2])
    return attention(q, k, v, starts, ends, q_start, D ** -0.5, window=window)


def _reference(q, k, v, starts, ends, window):
    L = q.shape[2]
    kr, vr = (t.double().repeat_interleave(HQ // HKV, 1) for t in (k, v))
    s = q.double() @ kr.transpose(-1, -2) * D ** -0.5
    i = torch.arange(L)
    visible = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window))[None, None] & \
        (i[None, None, None, :] >= starts.long()[:, None, None, None]) & \
        (i[None, None, None, :] < ends.long()[:, None, None, None])
    p = torch.softmax(s.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    return (p @ vr).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_accuracy_and_an_off_by_one_window_is_caught(dtype):
    q, k, v, starts, ends = qkv([150, 9, 70], 150, dtype)
    out = _run(q, k, v, starts, ends)
    real = torch.arange(150)[None, :] >= starts[:, None]
    error = lambda window: (out.double() - _reference(q, k, v, starts, ends, window)).abs()[real].max().item()  # noqa: E731
    assert error(WINDOW) < TOLERANCE[dtype]
    assert error(WINDOW + 1) > 10 * TOLERANCE[dtype] and error(WINDOW - 1) > 10 * TOLERANCE[dtype]
    assert error(10 ** 6) > 10 * TOLERANCE[dtype]  # no window at all


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_row_alone_equals_row_in_any_padded_batch(dtype):
    n = 140
    q, k, v, s0, e0 = qkv([n], n, dtype, seed=1)
    alone = _run(q, k, v, s0, e0)[0]
    for total, others, left in [(n + 13, [3, n + 13], True), (n + 64, [1], True), (n + 29, [n + 29, 2], False)]:
        lengths = others + [n]
        qb, kb, vb, sb, eb = qkv(lengths, total, dtype, seed=2, left=left)
        sl = slice(total - n, total) if left else slice(0, n)
        qb[-1, :, sl], kb[-1, :, sl], vb[-1, :, sl] = q[0], k[0], v[0]
        assert torch.equal(_run(qb, kb, vb, sb, eb)[-1, sl], alone), f"total={total} left={left}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_from_an_evicting_cache_equals_prefill(dtype):
    """A left-padded row (13 pads) decodes with a cache that kept only its last WINDOW - 1 keys,
    as transformers' sliding-window cache does: the indices shift, kv_start goes negative (the
    evicted first token), and every step gives the prefill's bits. Chunks of 5 queries too."""
    pads, n = 13, 150
    q, k, v, starts, ends = qkv([n], pads + n, dtype, seed=3)
    prefill = _run(q, k, v, starts, ends)[0]
    for step in (pads + 70, pads + 100, pads + n - 1):
        kept = slice(step - WINDOW + 1, step + 1)  # the cache's keys, then the new one
        offset = kept.start
        out = _run(q[:, :, step:step + 1], k[:, :, kept], v[:, :, kept], starts - offset, ends.clamp(max=step + 1) - offset,
                   q_start=torch.tensor([step - offset], dtype=torch.int32))
        assert torch.equal(out[0, 0], prefill[step]), step
    chunk = slice(pads + 90, pads + 95)
    kept = slice(chunk.start - WINDOW + 1, chunk.stop)
    out = _run(q[:, :, chunk], k[:, :, kept], v[:, :, kept], starts - kept.start, torch.tensor([chunk.stop - kept.start],
               dtype=torch.int32), q_start=torch.tensor([chunk.start - kept.start], dtype=torch.int32))
    assert torch.equal(out[0], prefill[chunk])


def test_negative_control_blocks_anchored_at_the_padded_index_0():
    """The same padded row with its blocks aligned to index 0 (kv_start 0, pads masked as keys
    out of range another way) instead of its first real token: other bits than alone."""
    n, pads = 140, 29
    q, k, v, s0, e0 = qkv([n], n, torch.bfloat16, seed=1)
    alone = _run(q, k, v, s0, e0)[0]
    qb, kb, vb, sb, eb = qkv([n], n + pads, torch.bfloat16, seed=2)
    qb[0, :, pads:], kb[0, :, pads:], vb[0, :, pads:] = q[0], k[0], v[0]
    kb[0, :, :pads] = -1e4  # pads that no query may weigh: scores of -inf after exp underflow
    anchored_at_0 = _run(qb, kb, vb, torch.zeros_like(sb), eb)[0, pads:]
    assert torch.equal(_run(qb, kb, vb, sb, eb)[0, pads:], alone)
    assert not torch.equal(anchored_at_0, alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_window_equals_padded_window(dtype):
    """Two sequences of 150 and 40 tokens in 64-slot pages: a chunk of 30 queries and a decode
    token each give the padded kernel's bits for those positions."""
    page = attention_config("cpu", dtype, D).block_n
    lengths = (150, 40)
    q, k, v, starts, ends = qkv([150], 150, dtype, seed=4)
    q2, k2, v2, s2, e2 = qkv([40], 40, dtype, seed=5)
    padded = [_run(q, k, v, starts, ends)[0], _run(q2, k2, v2, s2, e2)[0]]
    k_cache, v_cache, tables = paged_caches([(k, v), (k2, v2)], page)
    queries = torch.cat([q[0, :, 120:150].transpose(0, 1), q2[0, :, 39:40].transpose(0, 1)])
    out = paged_attention(queries, k_cache, v_cache, torch.tensor([0, 30, 31], dtype=torch.int32),
                          torch.tensor(lengths, dtype=torch.int32), tables, D ** -0.5, max_query_len=30,
                          window=WINDOW)
    assert torch.equal(out[:30], padded[0][120:150]) and torch.equal(out[30], padded[1][39])


def test_autograd_window_forward_bits_and_gradients_against_float64():
    q, k, v, starts, ends = qkv([100, 37], 100, torch.float32, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    q_start = torch.zeros_like(starts)
    out = attention_autograd(q, k, v, starts, ends, q_start, D ** -0.5, window=WINDOW)
    assert torch.equal(out.detach(), _run(q.detach(), k.detach(), v.detach(), starts, ends))
    grad = torch.randn_like(out)
    real = (torch.arange(100)[None, :] >= starts[:, None])[..., None, None].to(grad.dtype)
    (out * grad * real).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(q64, k64, v64, starts, ends, WINDOW)
    (ref * grad.double() * real.double()).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert (got.double() - want).abs().max().item() < 1e-5
