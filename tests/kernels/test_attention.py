"""Causal GQA attention: accuracy, padding/batch invariance, decode == prefill."""
import math

import pytest
import torch

from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import AttentionConfig, attention, attention_config

# Max abs error against float64 for unit-variance q/k/v (output magnitudes ~1).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-6}
HQ, HKV, D = 4, 2, 32


def _qkv(lengths, total, dtype, device, seed=0, left=True):
    """A padded batch: row b holds lengths[b] real tokens, left- or right-aligned in `total` slots."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q = torch.randn(B, HQ, total, D, generator=g)
    k = torch.randn(B, HKV, total, D, generator=g)
    v = torch.randn(B, HKV, total, D, generator=g)
    starts = torch.tensor([total - n if left else 0 for n in lengths], dtype=torch.int32)
    ends = starts + torch.tensor(lengths, dtype=torch.int32)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(q), cast(k), cast(v), starts.to(device), ends.to(device)


def _run(q, k, v, starts, ends, q_start=None, config=None):
    if q_start is None:  # queries are the last Lq of the Lk positions
        q_start = torch.full_like(starts, k.shape[2] - q.shape[2])
    return attention(q, k, v, starts, ends, q_start, D ** -0.5, config=config)


def _reference(q, k, v, starts, ends):
    B, _, L, _ = q.shape
    kr = k.double().repeat_interleave(HQ // HKV, 1)
    vr = v.double().repeat_interleave(HQ // HKV, 1)
    s = q.double() @ kr.transpose(-1, -2) * D ** -0.5
    i = torch.arange(L, device=q.device)
    visible = (i[None, :] <= i[:, None])[None, None] & \
        (i[None, None, None, :] >= starts.long()[:, None, None, None]) & \
        (i[None, None, None, :] < ends.long()[:, None, None, None])
    p = torch.softmax(s.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    return (p @ vr).transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_accuracy_with_gqa_and_padding(dtype, device):
    q, k, v, starts, ends = _qkv([90, 1, 37], 90, dtype, device)
    out = _run(q, k, v, starts, ends)
    ref = _reference(q, k, v, starts, ends)
    assert out.shape == (3, 90, HQ, D) and out.is_contiguous()
    real = torch.arange(90, device=device)[None, :] >= starts[:, None]
    assert (out.double() - ref).abs()[real].max().item() < TOLERANCE[dtype]
    # Left-pad queries see no key: finite zeros, never NaN.
    assert torch.isfinite(out).all()
    assert (out[~real] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_sample_alone_equals_sample_in_any_padded_batch(dtype, device):
    n = 70  # spans two 64-key blocks on CPU, more on GPU configs
    q, k, v, s0, e0 = _qkv([n], n, dtype, device, seed=1)
    alone = _run(q, k, v, s0, e0)[0]
    for total, others, left in [(n, [n, 5], True), (n + 13, [3, n + 13], True), (n + 64, [1], True),
                                (n + 29, [n + 29, 2], False), (n, [], True)]:
        lengths = others + [n]
        B = len(lengths)
        qb, kb, vb, sb, eb = _qkv(lengths, total, dtype, device, seed=2, left=left)
        # Place the sample as the last row, padded on the chosen side.
        sl = slice(total - n, total) if left else slice(0, n)
        qb[B - 1, :, sl], kb[B - 1, :, sl], vb[B - 1, :, sl] = q[0], k[0], v[0]
        out = _run(qb, kb, vb, sb, eb)
        assert torch.equal(out[B - 1, sl], alone), f"total={total} others={others} left={left}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_chunked_prefill_equal_prefill(dtype, device):
    q, k, v, starts, ends = _qkv([75, 40], 75, dtype, device, seed=3)
    prefill = _run(q, k, v, starts, ends)
    for pos in [0, 35, 63, 64, 74]:  # cache holds keys [0, pos]; one query at pos
        ends_at = torch.minimum(ends, torch.tensor(pos + 1, device=device, dtype=torch.int32))
        decode = _run(q[:, :, pos:pos + 1], k[:, :, :pos + 1], v[:, :, :pos + 1], starts, ends_at)
        assert torch.equal(decode[:, 0][starts <= pos], prefill[:, pos][starts <= pos]), f"pos={pos}"
    # Static-cache layout: keys buffer longer than the sequence, queries at q_start.
    chunk = _run(q[:, :, 60:63], k, v, starts, torch.minimum(ends, torch.tensor(63, device=device)),
                 q_start=torch.full_like(starts, 60))
    assert torch.equal(chunk, prefill[:, 60:63])


def test_negative_control_decode_with_other_block_size_differs():
    q, k, v, starts, ends = _qkv([200], 200, torch.float32, "cpu", seed=4)
    prefill = _run(q, k, v, starts, ends)
    block_n = attention_config("cpu", torch.float32, D).block_n
    other = AttentionConfig(block_m=32, block_n=block_n // 2)
    decode = _run(q[:, :, -1:], k, v, starts, ends, config=other)
    assert not torch.equal(decode[:, 0], prefill[:, -1])
    # The same decode with the fixed block size matches.
    assert torch.equal(_run(q[:, :, -1:], k, v, starts, ends)[:, 0], prefill[:, -1])
