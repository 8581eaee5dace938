"""Chunks and prefix hits under windows, in the scheduler and the KV cache manager on their own (pure
Python, no model): a chunk is shortened to what the free pages hold, so a prompt of many windows runs
in its windows' pages whatever the token budget, and its chunks still end at the linear-attention
state boundary; each manager answers its longest prefix hit and the hit is the one no manager
shortens. Negative controls: chunks that do not shrink need every page of the budget's chunk (the
request is refused and never admitted); a hit the saved states shorten to one whose window page was
reused is none (one pass over the managers would take it)."""
from __future__ import annotations

import itertools

from invariant_infer.engine.kv_cache_manager import KVCacheManager, page_hash
from invariant_infer.engine.kv_cache_managers import NO_PAGE, SlidingWindowManager
from invariant_infer.engine.linear_state import PrefixStates, QueuedStateCopies
from invariant_infer.engine.page_pool import PagePool
from invariant_infer.engine.sampling_params import SamplingParams
from invariant_infer.engine.scheduler import Scheduler
from invariant_infer.engine.sequence import Sequence
from invariant_infer.model.cache_specs import SlidingWindowSpec

PAGE = 4
WINDOW = 8  # two pages: a chunk starting at 4k reads pages k-2 and k-1 before its own
SLIDING = SlidingWindowSpec(1, 8, window=WINDOW)
PROMPT = 10 * WINDOW
_arrivals = itertools.count()


def sequence(prompt_len: int, max_tokens: int = 2) -> Sequence:
    arrival = next(_arrivals)
    return Sequence(f"r{arrival}", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0,
                    arrival=arrival)


def run(scheduler: Scheduler, seq: Sequence) -> list[tuple[int, int]]:
    """Steps until ``seq`` has its tokens, as the engine runs them; returns (chunk length, pages in use
    during the step) per step, and stops at a step that schedules nothing."""
    scheduler.add(seq)
    steps = []
    while seq.num_output_tokens < seq.params.max_tokens:
        chunks = scheduler.schedule()
        if not chunks:
            break
        steps.append((chunks[0].num_tokens, scheduler.blocks.num_used))
        for chunk in chunks:
            chunk.seq.num_computed += chunk.num_tokens
            scheduler.blocks.register_full_pages(chunk.seq)
            if chunk.completes:
                chunk.seq.append_token(7)
    return steps


def test_a_prompt_of_ten_windows_runs_in_its_windows_pages_whatever_the_budget():
    for budget in (64, 4096):
        blocks = KVCacheManager(num_pages=3, page_size=PAGE, group_specs=(SLIDING,))
        assert blocks.pages_to_run(PROMPT + 2, budget) == 3  # the window's two pages and one token's
        scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=budget)
        seq = sequence(PROMPT)
        steps = run(scheduler, seq)
        assert seq.num_output_tokens == 2 and scheduler.num_preemptions == 0
        assert steps[0] == (3 * PAGE, 3) and all(used <= 3 for _, used in steps)
        assert [count for count, _ in steps[1:]] == [PAGE] * (PROMPT // PAGE - 3) + [1]


def test_negative_control_chunks_that_do_not_shrink_need_the_budgets_chunk():
    blocks = KVCacheManager(num_pages=3, page_size=PAGE, group_specs=(SLIDING,))
    blocks.chunks_shrink = False
    assert blocks.pages_to_run(PROMPT + 2, 64) == blocks.pages_needed(PROMPT + 2, 64) == 19
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    seq = sequence(PROMPT)
    assert run(scheduler, seq) == [] and seq.num_computed == 0 and blocks.num_used == 0


def test_shrunk_chunks_still_end_at_the_state_boundary():
    """Five pages: a chunk holds what is free past the window's two, ending at the last multiple of
    the two-page state interval it passes; without states, where the free pages end it."""
    sizes = {}
    for interval in (None, 2 * PAGE):
        states = None if interval is None else PrefixStates(QueuedStateCopies(), capacity=16, interval=interval)
        blocks = KVCacheManager(num_pages=5, page_size=PAGE, group_specs=(SLIDING,), prefix_states=states)
        sizes[interval] = [count for count, _ in run(Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64),
                                                     sequence(PROMPT))]
    assert sizes[None][:3] == [5 * PAGE, 3 * PAGE, 3 * PAGE]
    assert sizes[2 * PAGE][:3] == [4 * PAGE, 2 * PAGE, 2 * PAGE]
    assert sum(sizes[2 * PAGE][:-1]) == PROMPT and all(size % (2 * PAGE) == 0 for size in sizes[2 * PAGE][:-1])


def test_a_windows_longest_hit_skips_past_an_uncached_page():
    """Pages 0-1 and 4-6 cached, 2-3 not: a hit of 7 pages reads its window's pages 5-6 (cached); up
    to 5, a hit of 5 or 4 reads page 3 and one of 3 page 2 (uncached): the longest is 2 (pages 0-1)."""
    pool = PagePool(8)
    manager = SlidingWindowManager(0, pool, PAGE, WINDOW)
    hashes = [page_hash(b"", [j]) for j in range(8)]
    for j in (0, 1, 4, 5, 6):
        pool.register(pool.take_free(), (0, hashes[j]))
    assert manager.longest_hit(7, hashes.__getitem__) == 7
    pool.register(pool.take_free(), (1, hashes[3]))  # another group's page 3: not this group's
    assert manager.longest_hit(5, hashes.__getitem__) == 2
    assert manager.longest_hit(1, hashes.__getitem__) == 1


def cached_with_states(copies: QueuedStateCopies) -> tuple[KVCacheManager, Sequence]:
    """A window's manager with saved states every two pages, after a sequence of 22 tokens ran in
    chunks of 8, 8 and 6 (states saved at 8 and 16) and was released: pages 0-4 cached, freed in the
    order 1, 0, 2 (the window left them), then 5 (partial), 4, 3 (released), after the ten never used."""
    states = PrefixStates(copies, capacity=4, interval=2 * PAGE)
    blocks = KVCacheManager(num_pages=16, page_size=PAGE, group_specs=(SLIDING,), prefix_states=states)
    first = sequence(5 * PAGE + 2)
    for count in (2 * PAGE, 2 * PAGE, PAGE + 2):
        blocks.allocate(first, count)
        first.num_computed += count
        blocks.register_full_pages(first)
    blocks.release(first)
    return blocks, Sequence("later", first.token_ids + [99] * 10, SamplingParams(), seed=0, arrival=next(_arrivals))


def test_a_hit_is_the_one_no_manager_shortens():
    """The window alone hits at 5 pages (page 5 was never cached), the states at 4 (every two): the
    hit is 4 pages, its window (pages 2-3) cached, with the state saved there restored."""
    copies = QueuedStateCopies()
    blocks, later = cached_with_states(copies)
    blocks.match_prefix(later)
    assert later.num_computed == 4 * PAGE and blocks.prefix_states.restored == 1
    assert copies.pending[-1] == ("restore", blocks.prefix_states.index_of[later.page_hashes[3]], later.block_row)
    assert later.pages[0][:2] == [NO_PAGE] * 2 and NO_PAGE not in later.pages[0][2:]


def test_negative_control_a_hit_the_states_shorten_past_an_evicted_window_page_is_none():
    """Pages 0-2 reused: the window still hits at 5 (pages 3-4), the states shorten it to 4, whose
    window reads page 2: no manager agrees on any hit (one pass over the managers would take 4)."""
    blocks, later = cached_with_states(QueuedStateCopies())
    for _ in range(10 + 3):  # the ten never used, then pages 1, 0 and 2
        blocks.pool.take_free()
    blocks.match_prefix(later)
    assert later.num_computed == 0 and later.pages == [] and blocks.prefix_states.restored == 0
