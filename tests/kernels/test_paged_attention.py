"""Paged variable-length attention: every token bitwise equal to the padded ``attention`` kernel.

The reference for a sequence is ``attention()`` on a left-padded batch (full prefill); the paged
kernel runs packed, unpadded batches over scattered, shuffled pages, as full prefill or as a
series of chunked-prefill / decode steps that write their K/V with ``write_kv`` first. Unwritten
cache slots and unused pages hold NaN, so a read of anything the kernel must not read shows.
"""
import functools
import math

import pytest
import torch

from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import AttentionConfig, attention, attention_config, paged_attention, write_kv

# Max abs error against float64 for unit-variance q/k/v (as in test_attention).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-6}
LENGTHS = [1, 5, 70, 130]           # spans 1, 1, 2 and 3 pages of 64 (CPU), more of 32 (CUDA fp32)
HEADS = [(4, 2, 16), (4, 1, 32)]    # (Hq, Hkv, D): GQA groups of 2 and 4


def _sequences(lengths, heads, dtype, device, seed=0):
    """Per sequence: q [n, Hq, D], k, v [n, Hkv, D]."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return [tuple(cast(torch.randn(n, h, d, generator=g)) for h in (hq, hkv, hkv)) for n in lengths]


def _padded(seqs, pad=11, config=None):
    """``attention()`` on a left-padded batch (full prefill): per sequence, its tokens' outputs [n, Hq, D]."""
    q0, k0, _ = seqs[0]
    width = max(q.shape[0] for q, _, _ in seqs) + pad
    B, (hq, d), hkv = len(seqs), q0.shape[1:], k0.shape[1]
    q = q0.new_zeros(B, hq, width, d)
    k, v = q0.new_zeros(B, hkv, width, d), q0.new_zeros(B, hkv, width, d)
    starts = []
    for b, (qs, ks, vs) in enumerate(seqs):
        n = qs.shape[0]
        q[b, :, width - n:], k[b, :, width - n:], v[b, :, width - n:] = qs.transpose(0, 1), ks.transpose(0, 1), \
            vs.transpose(0, 1)
        starts.append(width - n)
    dev = q0.device
    kv_start = torch.tensor(starts, dtype=torch.int32, device=dev)
    kv_end = torch.full_like(kv_start, width)
    out = attention(q, k, v, kv_start, kv_end, torch.zeros_like(kv_start), d ** -0.5, config=config)
    return [out[b, width - qs.shape[0]:] for b, (qs, _, _) in enumerate(seqs)]


class PagedCache:
    """A NaN-filled paged K/V cache with each sequence's pages drawn at random (non-contiguous, shuffled)."""

    def __init__(self, lengths, heads, dtype, device, page_size, seed=0, contiguous=False):
        _, hkv, d = heads
        self.page_size = page_size
        needed = [-(-n // page_size) for n in lengths]
        num_pages = sum(needed) + 3  # spare pages (NaN) so ids are not simply 0..N-1
        g = torch.Generator().manual_seed(seed)
        ids = torch.arange(num_pages) if contiguous else torch.randperm(num_pages, generator=g)
        self.pages, at = [], 0
        for k in needed:
            self.pages.append(ids[at:at + k].tolist())
            at += k
        nan_page = ids[-1].item()  # filler past a sequence's last page: NaN if it were ever used
        width = max(needed)
        self.block_tables = torch.tensor([p + [nan_page] * (width - len(p)) for p in self.pages],
                                         dtype=torch.int32, device=device)
        self.k = torch.full((num_pages, page_size, hkv, d), math.nan, dtype=dtype, device=device)
        self.v = torch.full_like(self.k, math.nan)

    def slots(self, s, positions):
        return torch.tensor([self.pages[s][p // self.page_size] * self.page_size + p % self.page_size
                             for p in positions], dtype=torch.int64, device=self.k.device)


def _step(cache, seqs, chunks, config=None, max_query_len=None, write=True):
    """One engine step: chunks = [(sequence index, first position, count)], packed in that order.
    Writes the chunks' K/V, then attends; returns each chunk's outputs [count, Hq, D]."""
    qs, ks, vs, slots, starts, lens = [], [], [], [], [0], []
    for s, p0, n in chunks:
        q, k, v = seqs[s]
        qs.append(q[p0:p0 + n]), ks.append(k[p0:p0 + n]), vs.append(v[p0:p0 + n])
        slots.append(cache.slots(s, range(p0, p0 + n)))
        starts.append(starts[-1] + n)
        lens.append(p0 + n)
    dev = cache.k.device
    if write:
        write_kv(torch.cat(ks), torch.cat(vs), cache.k, cache.v, torch.cat(slots))
    tables = cache.block_tables[[s for s, _, _ in chunks]]
    out = paged_attention(torch.cat(qs), cache.k, cache.v, torch.tensor(starts, dtype=torch.int32, device=dev),
                          torch.tensor(lens, dtype=torch.int32, device=dev), tables, qs[0].shape[-1] ** -0.5,
                          max_query_len=max_query_len or max(n for _, _, n in chunks), config=config)
    return [out[starts[i]:starts[i + 1]] for i in range(len(chunks))]


def _page_size(dtype, device, heads):
    return attention_config(device, dtype, heads[2]).block_n


@functools.lru_cache(maxsize=None)
def _full_prefill(dtype, device, heads):
    """(sequences, padded reference per sequence, paged full-prefill output per sequence)."""
    seqs = _sequences(LENGTHS, heads, dtype, device)
    cache = PagedCache(LENGTHS, heads, dtype, device, _page_size(dtype, device, heads), seed=1)
    # All sequences packed in one call, longest not first.
    order = [2, 0, 3, 1]
    outs = _step(cache, seqs, [(s, 0, LENGTHS[s]) for s in order])
    paged = [None] * len(LENGTHS)
    for s, o in zip(order, outs):
        paged[s] = o
    return seqs, _padded(seqs), paged


@pytest.mark.fast_cells(3)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_prefill_bitwise_equals_padded_attention(dtype, heads, device):
    _, ref, paged = _full_prefill(dtype, device, heads)
    for s, n in enumerate(LENGTHS):
        assert paged[s].shape == (n, heads[0], heads[2]) and torch.isfinite(paged[s]).all()
        assert torch.equal(paged[s], ref[s]), f"sequence {s} (length {n})"


# Per sequence: the step it joins at, then its chunk sizes (1 = a decode step). Chunks start and
# end mid-block and on block edges, and sequences at different stages share every step.
PLANS = {
    0: (4, [1]),
    1: (0, [3, 1, 1]),
    2: (1, [17, 3, 40, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
    3: (0, [1, 63, 64, 1, 1]),
}


@pytest.mark.fast_cells(3)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_and_decode_equal_full_prefill(dtype, heads, device):
    seqs, ref, _ = _full_prefill(dtype, device, heads)
    cache = PagedCache(LENGTHS, heads, dtype, device, _page_size(dtype, device, heads), seed=2)
    done = [0] * len(LENGTHS)
    steps = max(join + len(sizes) for join, sizes in PLANS.values())
    for step in range(steps):
        chunks = []
        for s in sorted(PLANS, key=lambda s: (step + s) % len(PLANS)):  # packing order varies per step
            join, sizes = PLANS[s]
            if join <= step < join + len(sizes):
                chunks.append((s, done[s], sizes[step - join]))
        for (s, p0, n), out in zip(chunks, _step(cache, seqs, chunks)):
            assert torch.equal(out, ref[s][p0:p0 + n]), f"step {step}: sequence {s} positions {p0}..{p0 + n - 1}"
            done[s] += n
    assert done == LENGTHS


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_does_not_depend_on_batch_pages_or_grid(device):
    dtype, heads = torch.bfloat16, HEADS[0]
    seqs = _sequences(LENGTHS, heads, dtype, device, seed=5)
    page = _page_size(dtype, device, heads)
    target = 3
    alone = PagedCache(LENGTHS, heads, dtype, device, page, contiguous=True)
    for s, n in enumerate(LENGTHS):
        write_kv(*seqs[s][1:], alone.k, alone.v, alone.slots(s, range(n)))
    ref = _step(alone, seqs, [(target, 0, LENGTHS[target])], write=False)[0]
    # Last 9 queries of the sequence, alone; then with other sequences (one with no query this
    # step), on other pages, with a larger grid, and with pages of two KV blocks each.
    tail = ref[-9:]
    assert torch.equal(_step(alone, seqs, [(target, LENGTHS[target] - 9, 9)], write=False)[0], tail)
    for seed, page_size, mqlen in [(7, page, None), (8, page, 200), (9, 2 * page, None)]:
        cache = PagedCache(LENGTHS, heads, dtype, device, page_size, seed=seed)
        for s, n in enumerate(LENGTHS):
            write_kv(*seqs[s][1:], cache.k, cache.v, cache.slots(s, range(n)))
        chunks = [(1, 0, 5), (target, 0, LENGTHS[target]), (0, 1, 0), (2, 60, 10)]
        outs = _step(cache, seqs, chunks, max_query_len=mqlen, write=False)
        assert torch.equal(outs[1], ref), f"seed={seed} page_size={page_size} max_query_len={mqlen}"
        assert outs[2].shape[0] == 0
        chunks = [(2, 69, 1), (target, LENGTHS[target] - 9, 9), (0, 0, 1)]
        assert torch.equal(_step(cache, seqs, chunks, max_query_len=mqlen, write=False)[1], tail)


def test_negative_control_other_block_size_differs():
    """The comparison can fail: a KV block of half the size (in 64-slot pages, or in 32-slot
    pages as an engine with another page size would use) changes the bits."""
    dtype, heads = torch.float32, HEADS[0]
    seqs, ref, _ = _full_prefill(dtype, "cpu", heads)
    block_n = attention_config("cpu", dtype, heads[2]).block_n
    other = AttentionConfig(block_m=32, block_n=block_n // 2)
    s = 3
    for page_size in (block_n, block_n // 2):
        cache = PagedCache(LENGTHS, heads, dtype, "cpu", page_size, seed=3)
        out = _step(cache, seqs, [(s, 0, LENGTHS[s])], config=other)[0]
        assert not torch.equal(out, ref[s]), f"page_size={page_size}"
    # The same paged call with the fixed block size matches.
    cache = PagedCache(LENGTHS, heads, dtype, "cpu", block_n, seed=3)
    assert torch.equal(_step(cache, seqs, [(s, 0, LENGTHS[s])])[0], ref[s])


def _float64_reference(q, k, v):
    """Naive causal softmax attention in float64: q [n, Hq, D], k, v [n, Hkv, D] -> [n, Hq, D]."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    kr, vr = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) * d ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(scores.masked_fill(~causal, -math.inf), -1)
    return torch.einsum("hqk,khd->qhd", p, vr)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accuracy_against_float64(dtype, heads, device):
    seqs, _, paged = _full_prefill(dtype, device, heads)
    for (q, k, v), out in zip(seqs, paged):
        err = (out.double() - _float64_reference(q, k, v)).abs().max().item()
        assert err < TOLERANCE[dtype], f"length {q.shape[0]}: max abs error {err}"


def test_write_kv_is_an_exact_indexed_copy_and_launcher_checks():
    heads, dtype = HEADS[0], torch.bfloat16
    cache = PagedCache([70, 5], heads, dtype, "cpu", 64, seed=4)
    (_, k, v), = _sequences([70], heads, dtype, "cpu", seed=6)
    slots = cache.slots(0, range(70))
    write_kv(k, v, cache.k, cache.v, slots.to(torch.int32))
    assert torch.equal(cache.k.view(-1, *k.shape[1:])[slots], k)
    assert torch.equal(cache.v.view(-1, *v.shape[1:])[slots], v)
    assert cache.k.isnan().sum() == cache.k.numel() - k.numel()  # nothing else written
    with pytest.raises(TypeError):
        write_kv(k.float(), v.float(), cache.k, cache.v, slots)
    with pytest.raises(RuntimeError):  # a cache whose slots are not one dimension: refused, not copied
        write_kv(k, v, cache.k.transpose(0, 1), cache.v.transpose(0, 1), slots)
    q = torch.zeros(3, 4, 16, dtype=dtype)
    args = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match="multiple"):  # a page would split a KV block
        paged_attention(q, cache.k[:, :32], cache.v[:, :32], *args, max_query_len=3)
    with pytest.raises(TypeError):
        paged_attention(q, cache.k, cache.v, args[0].long(), *args[1:], max_query_len=3)
    with pytest.raises(ValueError):
        paged_attention(q, cache.k, cache.v, args[1], args[1], *args[2:], max_query_len=3)
