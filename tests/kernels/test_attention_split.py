"""Split-KV attention: the KV chunk tree is fixed by the row's own positions, and the schedule
(chunks in sequence in one program, or in parallel programs merged by a combine kernel) never
moves a bit. CPU chunks are 128 keys (two 64-key blocks), so a few hundred keys cross several."""
import importlib

import pytest
import torch

from invariant_infer.kernels import AttentionConfig, attention, attention_config, paged_attention, write_kv
from invariant_infer.kernels.attention import attention_forward

HQ, HKV, D = 4, 2, 32


def _rows(lengths, total, dtype, seed, left=True):
    """A padded batch [B, H, total, D]: row b holds lengths[b] real tokens, left- or right-aligned."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q = torch.randn(B, HQ, total, D, generator=g).to(dtype)
    k = torch.randn(B, HKV, total, D, generator=g).to(dtype)
    v = torch.randn(B, HKV, total, D, generator=g).to(dtype)
    starts = torch.tensor([total - n if left else 0 for n in lengths], dtype=torch.int32)
    return q, k, v, starts, starts + torch.tensor(lengths, dtype=torch.int32)


@pytest.fixture
def combines(monkeypatch):
    """Counts the combine kernel's launches (the parallel schedule ran)."""
    calls = []
    for name in ("attention", "paged_attention"):  # the modules (the package re-exports functions by these names)
        module = importlib.import_module(f"invariant_infer.kernels.{name}")
        original = module.combine_chunks
        monkeypatch.setattr(module, "combine_chunks", lambda *a, original=original, **k: (calls.append(1),
                                                                                          original(*a, **k)))
    return calls


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype, window, with_sinks", [(torch.bfloat16, 100, True), (torch.float32, 0, False)])
def test_parallel_chunks_equal_sequential_chunks_padded(dtype, window, with_sinks, combines):
    """Rows of 330 and 45 keys, left padding, the last 40 queries (two tiles): output and lse
    bitwise equal whether the 3 chunks of 128 keys run in one program or in parallel."""
    q, k, v, starts, ends = _rows([330, 45], 330, dtype, seed=0)
    q = q[:, :, -40:].contiguous()
    q_start = torch.full_like(starts, 290)
    sinks = torch.randn(HQ, dtype=dtype) if with_sinks else None
    found = []
    for parallel in (False, True):
        lse = torch.empty(2, HQ, 40)
        out = attention_forward(q, k, v, starts, ends, q_start, D ** -0.5, lse=lse, window=window, sinks=sinks,
                                parallel_chunks=parallel)
        found.append((out, lse))
    assert len(combines) == 1
    assert torch.equal(found[0][0], found[1][0]) and torch.equal(found[0][1], found[1][1])
    assert torch.isfinite(found[0][0]).all()


def test_chunk_size_changes_the_bits_at_these_lengths():
    """The schedule tests' inputs cross chunk boundaries: another chunk size gives other bits, so a
    schedule that regrouped the chunks would be seen."""
    q, k, v, starts, ends = _rows([330], 330, torch.float32, seed=0)
    q = q[:, :, -40:].contiguous()
    q_start = torch.full_like(starts, 290)
    base = attention_config("cpu", torch.float32, D)
    default = attention(q, k, v, starts, ends, q_start, D ** -0.5)
    other = attention(q, k, v, starts, ends, q_start, D ** -0.5,
                      config=AttentionConfig(base.block_m, base.block_n, kv_chunk=2 * base.kv_chunk))
    assert not torch.equal(default, other)


def _paged_step(seqs, chunks, page_size, dtype, **kwargs):
    """Write every sequence's keys to shuffled pages, then attend for ``chunks`` = [(sequence,
    first position, count)] packed in that order; returns each chunk's output."""
    g = torch.Generator().manual_seed(5)
    need = [-(-q.shape[0] // page_size) for q, _, _ in seqs]
    ids = torch.randperm(sum(need) + 2, generator=g)
    k_cache = torch.full((sum(need) + 2, page_size, HKV, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, at = [], 0
    for (_, k, v), n in zip(seqs, need):
        pages = ids[at:at + n]
        at += n
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:k.shape[0]]
        write_kv(k, v, k_cache, v_cache, slots)
        tables.append(pages.tolist() + [int(ids[-1])] * (max(need) - n))
    qs = [seqs[s][0][p0:p0 + n] for s, p0, n in chunks]
    starts = torch.tensor([0] + [n for _, _, n in chunks], dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor([p0 + n for _, p0, n in chunks], dtype=torch.int32)
    table = torch.tensor([tables[s] for s, _, _ in chunks], dtype=torch.int32)
    out = paged_attention(torch.cat(qs), k_cache, v_cache, starts, lens, table, D ** -0.5,
                          max_query_len=max(n for _, _, n in chunks), **kwargs)
    return [out[starts[i]:starts[i + 1]] for i in range(len(chunks))]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype, window, with_sinks", [(torch.float32, 100, True), (torch.bfloat16, 0, False)])
def test_parallel_chunks_equal_sequential_chunks_paged(dtype, window, with_sinks, combines):
    """Chunked prefill and decode over 300 and 140 keys (3 and 2 chunks) next to a short sequence:
    the paged kernel's parallel schedule gives the sequential one's bits, which are the padded
    kernel's (the rows alone)."""
    g = torch.Generator().manual_seed(3)
    seqs = [tuple(torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV)) for n in (300, 140, 5)]
    sinks = torch.randn(HQ, dtype=dtype) if with_sinks else None
    chunks = [(0, 260, 40), (1, 139, 1), (2, 0, 5)]
    page = attention_config("cpu", dtype, D).block_n
    sequential = _paged_step(seqs, chunks, page, dtype, window=window, sinks=sinks)
    parallel = _paged_step(seqs, chunks, page, dtype, window=window, sinks=sinks, max_seq_len=300,
                           parallel_chunks=True)
    assert len(combines) == 1
    for s, (a, b) in enumerate(zip(sequential, parallel)):
        assert torch.equal(a, b), f"chunk {s}"
    for (s, p0, n), got in zip(chunks, sequential):
        q, k, v = (t.transpose(0, 1)[None] for t in seqs[s])
        length = torch.tensor([q.shape[2]], dtype=torch.int32)
        alone = attention(q, k, v, torch.zeros_like(length), length, torch.zeros_like(length), D ** -0.5,
                          window=window, sinks=sinks)
        assert torch.equal(got, alone[0, p0:p0 + n]), f"sequence {s}"


def test_paged_parallel_chunks_need_a_host_bound_on_the_context():
    from invariant_infer.errors import InvariantInferError

    q = torch.randn(1, HQ, D)
    cache = torch.zeros(1, 64, HKV, D)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(InvariantInferError, match="max_seq_len"):
        paged_attention(q, cache, cache, torch.tensor([0, 1], dtype=torch.int32), one, one[None] * 0, 1.0,
                        max_query_len=1, parallel_chunks=True)


def _alone_vs_padded(config_for):
    """The last 3 queries of a 400-key row alone, and in a batch where it is left-padded by 200."""
    q, k, v, starts, ends = _rows([400], 400, torch.float32, seed=7)
    qb, kb, vb, sb, eb = _rows([600, 400], 600, torch.float32, seed=8)
    qb[1, :, 200:], kb[1, :, 200:], vb[1, :, 200:] = q[0], k[0], v[0]
    found = []
    for q_, k_, v_, s_, e_ in ((q, k, v, starts, ends), (qb, kb, vb, sb, eb)):
        width = k_.shape[2]
        found.append(attention(q_[:, :, -3:].contiguous(), k_, v_, s_, e_, torch.full_like(s_, width - 3),
                               D ** -0.5, config=config_for(width)))
    return found[0][0], found[1][1]


def test_chunks_counted_from_kv_start_keep_a_row_alone_equal_to_padded():
    alone, padded = _alone_vs_padded(lambda width: None)
    assert torch.equal(alone, padded)


def test_negative_control_a_chunk_count_fixed_by_the_batch_breaks_invariance():
    """Four chunks per row whatever its width (their size from the batch's key width): the padded
    batch cuts the row's keys elsewhere and its bits change."""
    base = attention_config("cpu", torch.float32, D)

    def four_chunks(width):
        size = -(-width // 4 // base.block_n) * base.block_n
        return AttentionConfig(base.block_m, base.block_n, kv_chunk=size)
    alone, padded = _alone_vs_padded(four_chunks)
    assert not torch.equal(alone, padded)
