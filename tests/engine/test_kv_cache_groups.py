"""The KV cache manager over several KV cache groups, on its own (pure Python, no model): a sliding
window's group frees the pages its next chunk no longer reads, admission counts the pages of each
group, a prefix hit under a window needs only the window's pages before it, and the layout of the
tiny Gemma 3 / gpt-oss / windowed Mistral / Qwen3.5 configs into groups and page bytes."""
from __future__ import annotations

import itertools

import pytest
import torch

from invariant_infer.engine.kv_cache_layout import kv_cache_layout, pages_held
from invariant_infer.engine.kv_cache_manager import KVCacheManager
from invariant_infer.engine.kv_cache_managers import NO_PAGE
from invariant_infer.engine.sampling_params import SamplingParams
from invariant_infer.engine.sequence import Sequence
from invariant_infer.model.cache_specs import FullAttentionSpec, SlidingWindowSpec, cache_specs
from invariant_infer.testing.random_checkpoints import random_config

PAGE = 4
WINDOW = 6  # a query at p sees keys p - 5 .. p: a chunk starting at 8 reads page 0 no more
FULL, SLIDING = FullAttentionSpec(1, 8), SlidingWindowSpec(1, 8, window=WINDOW)
_arrivals = itertools.count()


def sequence(prompt_len: int, first_token: int = 0) -> Sequence:
    arrival = next(_arrivals)
    return Sequence(f"r{arrival}", list(range(first_token, first_token + prompt_len)), SamplingParams(), seed=0,
                    arrival=arrival)


def advance(blocks: KVCacheManager, seq: Sequence, count: int) -> None:
    """One step of ``count`` tokens, as the engine runs it."""
    assert blocks.can_allocate(seq, count)
    blocks.allocate(seq, count)
    seq.num_computed += count
    blocks.register_full_pages(seq)


def test_a_window_frees_the_pages_its_next_chunk_no_longer_reads():
    blocks = KVCacheManager(num_pages=10, page_size=PAGE, group_specs=(SLIDING, FULL))
    seq = sequence(30)
    advance(blocks, seq, 8)       # positions 0-7: two pages in each group
    assert [len(pages) for pages in seq.pages] == [2, 2] and blocks.num_used == 4
    advance(blocks, seq, 1)       # the next chunk starts at 9, reading keys from 4: page 0 is freed
    sliding, full = seq.pages
    assert sliding[0] == NO_PAGE and NO_PAGE not in sliding[1:] and NO_PAGE not in full
    assert blocks.num_used == 2 + 3 and blocks.pages_missing(seq, 3) == 0 and blocks.pages_missing(seq, 4) == 2
    for _ in range(12):
        advance(blocks, seq, 1)   # at 21, the window reads from position 16: pages 0-3 freed
    assert seq.pages[0][:4] == [NO_PAGE] * 4 and blocks.num_used == 2 + 6
    blocks.release(seq)
    assert blocks.num_used == 0 and seq.pages == []


def test_admission_counts_each_groups_pages_and_the_window_holds_few():
    blocks = KVCacheManager(num_pages=10, page_size=PAGE, group_specs=(SLIDING,))
    seq = sequence(200)
    for _ in range(50):           # 200 tokens in chunks of 4 through a cache of 10 pages
        advance(blocks, seq, 4)
        assert sum(page != NO_PAGE for page in seq.pages[0]) <= pages_held(SLIDING, 200, PAGE, 4) == 4
    assert blocks.pages_needed(200, 4) == 4
    two = KVCacheManager(num_pages=10, page_size=PAGE, group_specs=(SLIDING, FULL))
    assert two.pages_needed(200, 4) == 4 + 50 and two.pages_needed(5, 64) == 2 + 2


def test_a_prefix_hit_under_a_window_needs_only_the_windows_pages():
    blocks = KVCacheManager(num_pages=6, page_size=PAGE, group_specs=(SLIDING,))
    first = sequence(22)
    advance(blocks, first, 22)     # one chunk: every page allocated, then all but the last window's freed
    assert first.pages[0][:3] == [NO_PAGE] * 3
    blocks.release(first)
    again = sequence(21)           # hits at 5 pages (20 tokens): the window before 20 is pages 3-4
    blocks.match_prefix(again)
    assert again.num_computed == 5 * PAGE and again.pages[0][:3] == [NO_PAGE] * 3
    assert blocks.prefix_hits == 5 * PAGE
    blocks.release(again)
    # Pages 3-4 reused by others: the hit at 20 is gone, and none shorter has its window's pages
    hog = sequence(6 * PAGE, first_token=500)
    blocks.allocate(hog, 6 * PAGE)
    blocks.release(hog)
    late = sequence(21)
    blocks.match_prefix(late)
    assert late.num_computed == 0


def test_a_full_and_a_windowed_group_agree_on_the_shorter_hit():
    blocks = KVCacheManager(num_pages=16, page_size=PAGE, group_specs=(SLIDING, FULL))
    first = sequence(22)
    advance(blocks, first, 22)
    blocks.release(first)
    again = sequence(22)
    blocks.match_prefix(again)     # full: all 5 pages cached; window: pages 3-4 cached
    assert again.num_computed == 5 * PAGE and len(again.pages[1]) == 5 and again.pages[0][:3] == [NO_PAGE] * 3


def test_rolled_back_past_a_freed_page_the_sequence_starts_over():
    blocks = KVCacheManager(num_pages=8, page_size=PAGE, group_specs=(SLIDING,), enable_prefix_caching=False)
    seq = sequence(30)
    advance(blocks, seq, 16)       # pages 0-1 freed (the next chunk reads from 11)
    seq.num_computed = 8           # a draft's rejected tokens: a chunk at 8 would read page 0 again
    blocks.trim(seq)
    assert seq.pages == [] and seq.num_computed == 0 and blocks.num_used == 0


@pytest.mark.parametrize("family, overrides, groups, group_size", [
    ("qwen2", {}, [("full", (0, 1))], 2),
    ("qwen3_5_text", {}, [("full", (1,))], 1),
    ("mistral", {"sliding_window": 128}, [("sliding", (0, 1))], 2),
    ("gemma3_text", {}, [("sliding", (0,)), ("full", (1,))], 1),
    ("gpt_oss", {}, [("sliding", (0,)), ("full", (1,))], 1),
    ("gemma3_text", {"num_hidden_layers": 12, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2},
     [("sliding", (0, 1)), ("sliding", (2, 3)), ("sliding", (4, 6)), ("sliding", (7, 8)), ("sliding", (9, 10)),
      ("full", (5, 11))], 2),
], ids=["qwen2", "qwen3_5", "mistral-windowed", "gemma3", "gpt_oss", "gemma3-12-layers"])
def test_layers_of_equal_spec_form_groups_of_equal_size(family, overrides, groups, group_size):
    config = random_config(family, "tiny", **overrides)
    layout = kv_cache_layout(config)
    kinds = [("sliding" if isinstance(g.spec, SlidingWindowSpec) else "full", g.layers) for g in layout.groups]
    assert kinds == groups and layout.group_size == group_size
    spec = layout.groups[0].spec
    per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * 4
    assert layout.page_bytes(torch.float32, 64) == group_size * 64 * per_token_layer


def _page_bytes_of_each_group(layout, dtype=torch.bfloat16, page=16) -> set[int]:
    return {page * g.bytes_per_token(dtype) for g in layout.groups}  # a group's room: its layers and any padding


def test_specs_of_different_shapes_group_so_every_page_has_the_same_bytes():
    """Gemma 4 31B: 50 sliding layers of 16 KV heads x 256 and 10 global ones of 4 x 512 (half the
    bytes a token): groups of 5 sliding or 10 global layers, so pages of one size serve both."""
    layout = kv_cache_layout(random_config("gemma4_text", "gemma-4-31b"))
    sizes = {(type(g.spec).__name__, len(g.layers)) for g in layout.groups}
    assert sizes == {("SlidingWindowSpec", 5), ("FullAttentionSpec", 10)} and layout.group_size == 10
    assert sum(len(g.layers) for g in layout.groups) == 60
    assert _page_bytes_of_each_group(layout) == {layout.page_bytes(torch.bfloat16, 16)} == {5 * 16 * 2 * 16 * 256 * 2}


def test_kv_shared_layers_hold_no_pages_and_read_their_sources():
    """Gemma 4's tiny preset: layers 2 and 3 read layers 0's and 1's K/V (same tensors, no writes);
    the sliding (2 x 16) and global (1 x 32) groups are views of one buffer of equal pages."""
    layout = kv_cache_layout(random_config("gemma4_text", "tiny"))
    assert [g.layers for g in layout.groups] == [(0,), (1,)] and dict(layout.shared) == {2: 0, 3: 1}
    assert [layout.place(i) for i in range(4)] == [(0, 0), (1, 0), (0, 0), (1, 0)]
    assert [layout.writes_kv(i) for i in range(4)] == [True, True, False, False]
    k, v = layout.allocate(6, 4, torch.float32, "cpu", num_layers=4)
    assert [tuple(t.shape) for t in k] == [(6, 4, 2, 16), (6, 4, 1, 32), (6, 4, 2, 16), (6, 4, 1, 32)]
    assert k[2] is k[0] and v[3] is v[1]
    assert k[0].untyped_storage().data_ptr() == k[1].untyped_storage().data_ptr()  # one pool of pages
    # A page written through one group's view holds only that page's bytes: the other pages stay zero.
    k[1][3].fill_(1.0)
    v[1][3].fill_(2.0)
    assert k[0][3].abs().sum() > 0 and k[0][:3].abs().sum() == 0 and k[0][4:].abs().sum() == 0


def test_write_kv_into_a_groups_view_lands_in_its_pages():
    from invariant_infer.kernels import write_kv
    layout = kv_cache_layout(random_config("gemma4_text", "tiny"))
    k_caches, v_caches = layout.allocate(5, 4, torch.float32, "cpu", num_layers=4)
    keys, values = torch.randn(3, 1, 32), torch.randn(3, 1, 32)
    write_kv(keys, values, k_caches[1], v_caches[1], torch.tensor([9, 2, 17]))
    assert torch.equal(k_caches[1][2, 1], keys[0]) and torch.equal(v_caches[1][0, 2], values[1])
    assert torch.equal(k_caches[1][4, 1], keys[2])


def test_shapes_without_equal_whole_groups_pad_a_group_and_its_views_stay_apart():
    """One sliding layer of 2 x 16 beside one global layer of 2 x 32: no whole groups give equal pages,
    so the sliding group's pages have room for 2 layers and hold 1: its K and V are views of their own
    bytes of the page's first half, the other half padding (any page serves either group, one at a time)."""
    config = random_config("gemma4_text", "tiny", num_global_key_value_heads=2, num_kv_shared_layers=0,
                           num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    layout = kv_cache_layout(config)
    assert [(g.layers, g.slots) for g in layout.groups] == [((0,), 2), ((1,), 1)]
    assert _page_bytes_of_each_group(layout) == {layout.page_bytes(torch.bfloat16, 16)} == {16 * 2 * 32 * 2 * 2}
    assert [16 * g.spec.kv_bytes_per_token(torch.bfloat16) for g in layout.groups] == [2048, 4096]  # half a page
    k, v = layout.allocate(3, 4, torch.float32, "cpu", num_layers=2)
    assert [tuple(t.shape) for t in k + v] == [(3, 4, 2, 16), (3, 4, 2, 32)] * 2
    assert k[0].untyped_storage().data_ptr() == k[1].untyped_storage().data_ptr()  # one pool of pages
    k[0].fill_(1.0)
    v[0].fill_(2.0)
    assert bool((k[0] == 1).all()) and bool((v[0] == 2).all())
    pool = torch.empty(0).set_(k[0].untyped_storage()).view(3, -1)  # [pages, page elements]
    assert pool.shape[1] == 2 * k[0][0].numel() * 2 and pool[:, :pool.shape[1] // 2].sum() == 3 * 3 * k[0][0].numel()
    assert not pool[:, pool.shape[1] // 2:].any()  # the padding: no layer's bytes


def test_gemma_4_26b_a4b_groups_and_its_bytes_per_token():
    """Gemma 4 26B-A4B: 25 sliding layers of 8 KV heads x 256 and 5 global ones of 2 x 512 (half the
    bytes a token) admit no whole groups of equal pages: groups of 1 sliding layer, and global groups
    of 2, 2 and 1 in pages with room for 2. Its K and V are 225,280 bytes a token in bf16, K and V of the
    global layers kept apart (K is k_norm'ed and rotated, V v_norm'ed: equal only before the norms), not
    the 215,040 of the K = V count; the pages give 229,376 (the padded slot)."""
    config = random_config("gemma4_text", "gemma-4-26b-a4b")
    specs = cache_specs(config)
    assert specs == ((SlidingWindowSpec(8, 256, window=1024),) * 5 + (FullAttentionSpec(2, 512),)) * 5
    assert sum(spec.kv_bytes_per_token(torch.bfloat16) for spec in specs) == \
        25 * 8 * 256 * 2 * 2 + 5 * 2 * 512 * 2 * 2 == 225280 == 215040 + 5 * 2 * 512 * 2
    layout = kv_cache_layout(config)
    full = [g for g in layout.groups if isinstance(g.spec, FullAttentionSpec)]
    assert [(g.layers, g.slots) for g in full] == [((5, 11), 2), ((17, 23), 2), ((29,), 2)]
    assert all(g.slots == len(g.layers) == 1 for g in layout.groups if g not in full) and len(layout.groups) == 28
    assert _page_bytes_of_each_group(layout) == {layout.page_bytes(torch.bfloat16, 16)} == {16 * 8192}
    assert sum(g.bytes_per_token(torch.bfloat16) for g in layout.groups) == 229376
