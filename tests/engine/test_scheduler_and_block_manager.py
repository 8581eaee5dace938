"""The scheduler and the KV cache manager on their own: pure Python, no model. A step is simulated as
the engine runs it: each chunk's positions become computed, full pages are registered for prefix
caching, and a chunk that reaches its sequence's last token appends one output token."""
from __future__ import annotations

import itertools

import pytest

from invariant_infer.engine.kv_cache_manager import KVCacheManager
from invariant_infer.engine.linear_state import PrefixStates
from invariant_infer.engine.sampling_params import SamplingParams
from invariant_infer.engine.scheduler import Scheduler
from invariant_infer.engine.sequence import Sequence, Status
from invariant_infer.errors import EngineBusyError

PAGE = 4
_arrivals = itertools.count()


def sequence(prompt_len: int, *, first_token: int = 0, request_id: str | None = None, changed: dict | None = None,
             **params) -> Sequence:
    """A waiting sequence of prompt tokens first_token, first_token + 1, ... (``changed``: {position: token})."""
    arrival = next(_arrivals)
    prompt = list(range(first_token, first_token + prompt_len))
    for position, token in (changed or {}).items():
        prompt[position] = token
    return Sequence(request_id or f"r{arrival}", prompt, SamplingParams(**params), seed=0, arrival=arrival)


def run_step(scheduler: Scheduler, next_token: int = 7) -> list[tuple[str, int, int]]:
    """One engine step without a model; returns (request id, start, tokens) per scheduled chunk."""
    chunks = scheduler.schedule()
    for chunk in chunks:
        seq = chunk.seq
        seq.num_computed += chunk.num_tokens - len(chunk.draft)
        scheduler.blocks.register_full_pages(seq)
        if chunk.completes:
            seq.append_token(next_token)
    return [(chunk.seq.request_id, chunk.start, chunk.num_tokens) for chunk in chunks]


def computed(blocks: KVCacheManager, seq: Sequence) -> None:
    """Mark every token of ``seq`` computed, on pages allocated for them."""
    blocks.allocate(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    blocks.register_full_pages(seq)


# -- KV cache manager (one full-attention group) ---------------------------------------------------------------------------------

def test_allocation_counts_pages_and_release_returns_them():
    blocks = KVCacheManager(num_pages=8, page_size=PAGE)
    seq = sequence(9)
    assert blocks.pages_for(9) == 3 and blocks.pages_missing(seq, 9) == 3
    blocks.allocate(seq, 9)
    assert len(seq.pages[0]) == 3 and blocks.num_used == 3 and blocks.num_free == 5
    assert all(blocks.pool.ref_counts[page] == 1 for page in seq.pages[0])
    seq.num_computed = 9
    assert blocks.pages_missing(seq, 3) == 0 and blocks.pages_missing(seq, 4) == 1  # 12 fits, 13 does not
    blocks.release(seq)
    assert seq.pages == [] and seq.num_computed == 0 and blocks.num_free == 8


def test_shared_prefix_pages_are_reference_counted():
    blocks = KVCacheManager(num_pages=8, page_size=PAGE)
    first = sequence(10)
    computed(blocks, first)  # pages 0 and 1 full, page 2 partial
    second = sequence(10)    # the same 10 tokens
    blocks.match_prefix(second)
    assert second.pages[0] == first.pages[0][:2] and second.num_computed == 2 * PAGE
    assert [blocks.pool.ref_counts[page] for page in first.pages[0]] == [2, 2, 1]
    assert blocks.prefix_hits == 2 * PAGE
    blocks.release(first)
    assert [blocks.pool.ref_counts[page] for page in second.pages[0]] == [1, 1] and blocks.num_used == 2
    blocks.release(second)
    assert blocks.num_used == 0


def test_a_prefix_hit_leaves_the_last_token_to_compute():
    blocks = KVCacheManager(num_pages=8, page_size=PAGE)
    computed(blocks, sequence(2 * PAGE))
    again = sequence(2 * PAGE)  # every page cached: the last token must still run, for its logits
    blocks.match_prefix(again)
    assert again.num_computed == PAGE and len(again.pages[0]) == 1


def test_no_hit_across_hash_seeds_with_prompt_logprobs_or_with_caching_off():
    blocks = KVCacheManager(num_pages=16, page_size=PAGE)
    computed(blocks, sequence(9))
    other_adapter = sequence(9)
    other_adapter.hash_seed = b"adapter digest"
    blocks.match_prefix(other_adapter)
    assert other_adapter.num_computed == 0
    wants_logprobs = sequence(9, prompt_logprobs=1)
    blocks.match_prefix(wants_logprobs)
    assert wants_logprobs.num_computed == 0
    off = KVCacheManager(num_pages=8, page_size=PAGE, enable_prefix_caching=False)
    computed(off, sequence(9))
    assert off.page_of_hash == {}
    later = sequence(9)
    off.match_prefix(later)
    assert later.num_computed == 0


def test_a_different_token_breaks_the_chain_at_its_page():
    blocks = KVCacheManager(num_pages=16, page_size=PAGE)
    computed(blocks, sequence(13))
    diverges = sequence(13, changed={PAGE + 1: 999})  # inside page 1
    blocks.match_prefix(diverges)
    assert diverges.num_computed == PAGE


def test_freed_pages_stay_findable_until_reused_least_recently_freed_first():
    blocks = KVCacheManager(num_pages=4, page_size=PAGE)
    old = sequence(2 * PAGE + 1, first_token=100)
    computed(blocks, old)  # pages 0, 1 full and cached, page 2 partial
    blocks.release(old)
    assert blocks.num_free == 4 and len(blocks.page_of_hash) == 2
    found = sequence(2 * PAGE + 1, first_token=100)
    blocks.match_prefix(found)
    assert found.num_computed == 2 * PAGE  # a hit on free pages
    blocks.release(found)
    # A new sequence takes free pages least recently freed first; the cached ones go last,
    # and a cached page that is taken loses its hash.
    order = list(blocks.pool.free)
    newcomer = sequence(3 * PAGE, first_token=500)
    blocks.allocate(newcomer, 3 * PAGE)
    assert newcomer.pages[0] == order[:3]
    evicted = [page for page in newcomer.pages[0] if page in (0, 1)]
    assert evicted and all(blocks.pool.hash_of[page] is None for page in evicted)
    assert len(blocks.page_of_hash) == 2 - len(evicted)
    probe = sequence(2 * PAGE + 1, first_token=100)
    blocks.match_prefix(probe)
    assert probe.num_computed < 2 * PAGE


def test_trim_frees_the_pages_past_the_computed_positions():
    blocks = KVCacheManager(num_pages=8, page_size=PAGE)
    seq = sequence(5)
    blocks.allocate(seq, 5 + 6)  # room for 6 proposals
    assert len(seq.pages[0]) == 3
    seq.num_computed = 6         # two proposals accepted
    blocks.trim(seq)
    assert len(seq.pages[0]) == 2 and blocks.num_used == 2


def test_a_full_cache_refuses_allocation_and_a_reset_needs_every_page_free():
    blocks = KVCacheManager(num_pages=2, page_size=PAGE)
    first = sequence(2 * PAGE)
    computed(blocks, first)
    assert blocks.num_free == 0 and not blocks.can_allocate(sequence(1), 1)
    with pytest.raises(EngineBusyError, match="2 KV pages are in use"):
        blocks.reset_prefix_cache()
    blocks.release(first)
    assert blocks.reset_prefix_cache() == 2 and blocks.page_of_hash == {}
    again = sequence(2 * PAGE)
    blocks.match_prefix(again)
    assert again.num_computed == 0


# -- scheduler -------------------------------------------------------------------------------------

def test_first_come_first_served_within_the_sequence_cap():
    scheduler = Scheduler(KVCacheManager(num_pages=32, page_size=PAGE), max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = sequence(3), sequence(3), sequence(3)
    for seq in (a, b, c):
        scheduler.add(seq)
    assert run_step(scheduler) == [(a.request_id, 0, 3), (b.request_id, 0, 3)]
    assert c.status is Status.WAITING and list(scheduler.waiting) == [c]
    # running sequences decode one token each; c still waits for a seat
    assert run_step(scheduler) == [(a.request_id, 3, 1), (b.request_id, 3, 1)]
    scheduler.remove(a)
    assert run_step(scheduler) == [(b.request_id, 4, 1), (c.request_id, 0, 3)]


def test_a_long_prefill_runs_in_chunks_beside_decode_tokens():
    scheduler = Scheduler(KVCacheManager(num_pages=32, page_size=PAGE), max_num_seqs=4, max_num_batched_tokens=8)
    short = sequence(2)
    scheduler.add(short)
    run_step(scheduler)
    long = sequence(20)
    scheduler.add(long)
    assert run_step(scheduler) == [(short.request_id, 2, 1), (long.request_id, 0, 7)]
    assert long.output_ids == ()  # no token until its prefill completes
    assert run_step(scheduler) == [(short.request_id, 3, 1), (long.request_id, 7, 7)]
    assert run_step(scheduler) == [(short.request_id, 4, 1), (long.request_id, 14, 6)]
    assert long.output_ids == (7,) and long.num_computed == 20


def test_preemption_frees_the_latest_admitted_and_recomputes_it_first():
    blocks = KVCacheManager(num_pages=3, page_size=PAGE)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    early, late = sequence(PAGE), sequence(PAGE + 1, first_token=100)  # no shared prefix
    scheduler.add(early)
    scheduler.add(late)
    run_step(scheduler)  # one page for early, two for late: the cache is full
    queued = sequence(2)
    scheduler.add(queued)
    # early's next token needs a page: late, admitted after it, is preempted to free two
    assert run_step(scheduler) == [(early.request_id, PAGE, 1)]
    assert scheduler.num_preemptions == 1
    assert late.status is Status.WAITING and late.pages == [] and late.num_computed == 0
    assert list(scheduler.waiting) == [late, queued]  # first in line, before the one that never ran
    assert late.output_ids == (7,)  # its sampled token stays: it is recomputed from its tokens
    scheduler.remove(early)
    # its first page is still cached (freed, not reused): it recomputes from there
    assert run_step(scheduler) == [(late.request_id, PAGE, 2), (queued.request_id, 0, 2)]


def test_a_waiting_sequence_without_pages_waits_and_gives_back_its_prefix_pages():
    blocks = KVCacheManager(num_pages=3, page_size=PAGE)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    cached = sequence(2 * PAGE + 1, first_token=50)
    computed(blocks, cached)
    blocks.release(cached)          # two cached pages, free
    hog = sequence(2, first_token=900)
    scheduler.add(hog)
    run_step(scheduler)             # takes the one uncached free page first
    big = sequence(4 * PAGE, first_token=50)  # its first two pages are cached, it needs two more
    scheduler.add(big)
    assert run_step(scheduler) == [(hog.request_id, 2, 1)]
    assert big.status is Status.WAITING and big.pages == [] and big.num_computed == 0
    assert blocks.num_used == 1     # the prefix pages it matched went back


class Allowed:
    """An admission rule: only the named requests run (as the LoRA slots admit those whose adapter has a slot)."""

    def __init__(self, *names):
        self.names = set(names)

    def can_admit(self, seq, running) -> bool:
        return seq.request_id in self.names


def test_admission_waits_for_can_admit():
    allowed = Allowed("yes")
    scheduler = Scheduler(KVCacheManager(num_pages=8, page_size=PAGE), max_num_seqs=4, max_num_batched_tokens=64,
                          admission=allowed)
    blocked, after = sequence(2, request_id="no"), sequence(2, request_id="yes")
    scheduler.add(blocked)
    scheduler.add(after)
    assert run_step(scheduler) == []  # FCFS: the one behind it waits too
    allowed.names.add("no")
    assert [chunk[0] for chunk in run_step(scheduler)] == ["no", "yes"]


def test_proposals_extend_decode_chunks_only_within_budget_and_pages():
    blocks = KVCacheManager(num_pages=4, page_size=PAGE)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=4)
    seq = sequence(PAGE - 1)
    scheduler.add(seq)
    run_step(scheduler)
    seq.draft_ids = [1, 2, 3, 4, 5]
    chunks = scheduler.schedule()
    assert len(chunks) == 1 and chunks[0].num_tokens == 4 and chunks[0].draft == [1, 2, 3]  # the budget
    assert chunks[0].token_ids == [7, 1, 2, 3]
    blocks.trim(seq)  # none verified
    assert len(seq.pages[0]) == 1
    other = sequence(2 * PAGE - 1)
    blocks.allocate(other, 2 * PAGE - 1)  # one free page left
    scheduler.max_num_batched_tokens = 64
    chunks = scheduler.schedule()
    assert chunks[0].draft == [1, 2, 3, 4]  # the one free page holds four of the five


# -- hybrid models: saved linear-attention states ---------------------------------------------------

class Store:
    def __init__(self):
        self.copies = []

    def save(self, slot, index):
        self.copies.append(("save", slot, index))

    def restore(self, index, slot):
        self.copies.append(("restore", index, slot))


def test_prefill_chunks_end_at_the_last_boundary_they_pass():
    states = PrefixStates(Store(), capacity=1, interval=2 * PAGE)  # the linear-state manager's boundary
    scheduler = Scheduler(KVCacheManager(num_pages=64, page_size=PAGE, prefix_states=states), max_num_seqs=4,
                          max_num_batched_tokens=10)
    seq = sequence(23)
    scheduler.add(seq)
    sizes = [run_step(scheduler)[0][2] for _ in range(5)]
    assert sizes == [8, 8, 7, 1, 1]  # 0-8, 8-16 (each budget of 10 cut at 8), 16-23 (no boundary), decode
    plain = Scheduler(KVCacheManager(num_pages=64, page_size=PAGE), max_num_seqs=4, max_num_batched_tokens=10)
    plain.add(sequence(23))
    assert [run_step(plain)[0][2] for _ in range(3)] == [10, 10, 3]


def test_a_hybrid_hit_ends_where_a_state_is_saved_and_restores_it_into_the_slot():
    store = Store()
    states = PrefixStates(store, capacity=2, interval=2 * PAGE)
    blocks = KVCacheManager(num_pages=32, page_size=PAGE, prefix_states=states)
    first = sequence(4 * PAGE + 1)
    blocks.allocate(first, first.num_tokens)
    for done in (PAGE, 2 * PAGE, 3 * PAGE, first.num_tokens):  # states saved at 8 only (16 is never reached)
        first.num_computed = done
        blocks.register_full_pages(first)
    assert store.copies == [("save", first.block_row, 0)] and len(states) == 1
    later = sequence(4 * PAGE + 3)  # four cached pages, but a state at 8 only
    blocks.match_prefix(later)
    assert later.num_computed == 2 * PAGE and len(later.pages[0]) == 2
    assert store.copies[-1] == ("restore", 0, later.block_row) and states.restored == 1
    short = sequence(2 * PAGE)  # its last token must run: no hit at 8, and none before (no state at 4)
    blocks.match_prefix(short)
    assert short.num_computed == 0 and len(store.copies) == 2


def test_saved_states_are_evicted_least_recently_used_and_cleared_with_the_cache():
    store = Store()
    states = PrefixStates(store, capacity=2, interval=PAGE)
    for key in (b"a", b"b"):
        states.save(key, slot=0)
    states.restore(b"a", slot=1)  # a is now the most recently used
    states.save(b"c", slot=2)     # evicts b
    assert b"a" in states and b"c" in states and b"b" not in states
    assert store.copies[-1] == ("save", 2, store.copies[1][2])  # c took b's index
    blocks = KVCacheManager(num_pages=4, page_size=PAGE, prefix_states=states)
    blocks.reset_prefix_cache()
    assert len(states) == 0 and sorted(states.free) == [0, 1]
