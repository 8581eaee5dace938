"""Decode == prefill and batch invariance past many KV chunks: contexts of 4K-8K keys at head_dim
128 (32-64 CPU chunks of 128 keys), in the padded and the paged kernels, both schedules. Only the
last few positions are queried (a prefill chunk at q_start near the end), which reduces exactly
as a full prefill's rows do, at a fraction of the interpreter's cost."""
import pytest
import torch

from invariant_infer.kernels import attention, paged_attention, write_kv

D = 128


def _sequence(length, heads, dtype, seed):
    """q [1, Hq, L, D], k, v [1, 1, L, D]: one KV head."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, length, D, generator=g).to(dtype) for h in (heads, 1, 1))


def _padded_batch(seq, others, width, left):
    """The sequence as the last row of a batch ``width`` keys wide, padded on the left or right,
    after rows of ``others`` tokens (random); (q, k, v, kv_start, kv_end, slice of the sequence)."""
    q0, k0, v0 = seq
    n, heads = q0.shape[2], q0.shape[1]
    g = torch.Generator().manual_seed(99)
    B = len(others) + 1
    q = torch.randn(B, heads, width, D, generator=g).to(q0.dtype)
    k, v = (torch.randn(B, 1, width, D, generator=g).to(q0.dtype) for _ in range(2))
    lengths = others + [n]
    starts = torch.tensor([width - m if left else 0 for m in lengths], dtype=torch.int32)
    at = slice(width - n, width) if left else slice(0, n)
    q[-1, :, at], k[-1, :, at], v[-1, :, at] = q0[0], k0[0], v0[0]
    return q, k, v, starts, starts + torch.tensor(lengths, dtype=torch.int32), at


def _check_padded(length, heads, dtype, window=0, sinks=None, last=6, decodes=1):
    seq = _sequence(length, heads, dtype, seed=length)
    q, k, v = seq
    one = torch.tensor([length], dtype=torch.int32)
    zero = torch.zeros_like(one)
    scale = D ** -0.5
    # The last ``last`` positions as one prefill chunk (queries at q_start, all keys present).
    prefill = attention(q[:, :, -last:].contiguous(), k, v, zero, one, one - last, scale, window=window, sinks=sinks)
    for parallel in (False, True):
        for pos in range(length - decodes, length):  # decode: the cache holds keys [0, pos]
            decode = attention(q[:, :, pos:pos + 1].contiguous(), k[:, :, :pos + 1], v[:, :, :pos + 1], zero,
                               one * 0 + pos + 1, one * 0 + pos, scale, window=window, sinks=sinks,
                               parallel_chunks=parallel)
            assert torch.equal(decode[0, 0], prefill[0, pos - length + last]), f"pos={pos} parallel={parallel}"
    for others, extra, left in (([300], 77, True), ([9], 40, False)):  # the other rows' walks cost, not their length
        qb, kb, vb, sb, eb, at = _padded_batch(seq, others, length + extra, left)
        width = qb.shape[2]
        first = at.stop - last  # the same queries, at their place in the padded row
        out = attention(qb[:, :, first:at.stop].contiguous(), kb, vb, sb, eb, torch.full_like(sb, first), scale,
                        window=window, sinks=sinks, parallel_chunks=not left)
        assert torch.equal(out[-1], prefill[0]), f"others={others} width={width} left={left}"


def test_padded_decode_equals_prefill_and_batch_at_4k_keys():
    _check_padded(4096, 1, torch.float32)


@pytest.mark.heavy
def test_padded_decode_equals_prefill_and_batch_at_8k_keys_bf16_window_and_sinks():
    _check_padded(8000, 2, torch.bfloat16, window=3000, sinks=torch.tensor([0.5, -1.0], dtype=torch.bfloat16),
                  decodes=3)


def _paged_run(seqs, chunks, dtype, parallel, page_size=64, **kwargs):
    """Every sequence's keys in shuffled pages; attend for chunks [(sequence, first, count)]."""
    g = torch.Generator().manual_seed(1)
    need = [-(-s[1].shape[2] // page_size) for s in seqs]
    ids = torch.randperm(sum(need), generator=g)
    k_cache = torch.full((sum(need), page_size, 1, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, at = [], 0
    for (_, k, v), n in zip(seqs, need):
        pages = ids[at:at + n]
        at += n
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:k.shape[2]]
        write_kv(k[0].transpose(0, 1), v[0].transpose(0, 1), k_cache, v_cache, slots)
        tables.append(pages.tolist() + [0] * (max(need) - n))
    q = torch.cat([seqs[s][0][0, :, p0:p0 + n].transpose(0, 1) for s, p0, n in chunks])
    starts = torch.tensor([0] + [n for _, _, n in chunks]).cumsum(0).to(torch.int32)
    lens = torch.tensor([p0 + n for _, p0, n in chunks], dtype=torch.int32)
    table = torch.tensor([tables[s] for s, _, _ in chunks], dtype=torch.int32)
    out = paged_attention(q, k_cache, v_cache, starts, lens, table, D ** -0.5, max_query_len=max(n for *_, n in chunks),
                          max_seq_len=int(lens.max()), parallel_chunks=parallel, **kwargs)
    return [out[starts[i]:starts[i + 1]] for i in range(len(chunks))]


@pytest.mark.heavy
@pytest.mark.parametrize("length, dtype", [(4096, torch.float32), (7000, torch.bfloat16)])
def test_paged_decode_and_chunks_equal_padded_prefill_in_any_batch(length, dtype):
    """A long sequence's last positions, as a prefill chunk and as decode steps, next to a short and
    a mid-length sequence, in either schedule: the padded kernel's bits for the sequence alone."""
    seqs = [_sequence(n, 2, dtype, seed=n) for n in (length, 300, 5)]
    q, k, v = seqs[0]
    one = torch.tensor([length], dtype=torch.int32)
    prefill = attention(q[:, :, -4:].contiguous(), k, v, one * 0, one, one - 4, D ** -0.5)[0]
    for parallel in (False, True):
        chunk = _paged_run(seqs, [(0, length - 4, 4), (1, 299, 1), (2, 0, 5)], dtype, parallel)[0]
        assert torch.equal(chunk, prefill), f"parallel={parallel}"
        decode = _paged_run(seqs, [(2, 4, 1), (0, length - 1, 1), (1, 290, 10)], dtype, parallel)[1]
        assert torch.equal(decode[0], prefill[-1]), f"parallel={parallel}"
