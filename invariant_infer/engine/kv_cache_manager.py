"""The KV cache manager: one manager per KV cache group (``kv_cache_managers``) over one page pool
(``page_pool``), and the linear-attention state manager (``linear_state``), combined.

A page holds ``page_size`` consecutive positions of one sequence for every layer of one group, and
page_size is the attention kernel's KV block, so a page never splits a block. A full page is
identified by a hash chained over the token ids of its sequence up to its end: the KV of a token
depends only on the tokens before it (and blocks are aligned to the sequence start), so two
sequences with the same prefix may share those pages and get bitwise the same attention (with
images, the chain also takes the digests of the images a page holds tokens of).

Combined: a prefix hit is the longest every manager agrees on, each asked for its longest hit up
to the others' until none shortens it (full attention: all its pages cached; a window: the pages
its next chunk reads; linear attention: a saved state there); ``can_allocate`` / ``allocate``
count the pages every group misses against the one free list, so admission and preemption count
memory per spec; after each step a window's group frees the pages its next chunk no longer reads.
Where a group frees pages behind the sequence, a chunk's pages grow with its length, so a chunk is
shortened to what the free pages hold (``chunk_that_fits``): a long prompt runs in chunks within
its windows' pages, and a request needs only its windows and one token's pages to run
(``pages_to_run``).

The block table: each sequence holding pages owns a row of it in every group (``seq.block_row``,
also its linear-attention state slot), and every page added to a sequence is logged as a write
``(group, row, column, page)`` in ``table_writes``, which the model runner applies to its persistent
copy on the device; no step rebuilds a sequence's row.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..errors import EngineBusyError, InternalError
from ..model.cache_specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec
from .kv_cache_layout import pages_held
from .kv_cache_managers import FullAttentionManager, SlidingWindowManager, pages_for
from .linear_state import LinearStateManager, PrefixStates
from .page_pool import PagePool
from .sequence import Sequence

ONE_GROUP = (FullAttentionSpec(num_kv_heads=1, head_dim=1),)  # the bytes do not matter to the manager


def block_table_rows(max_num_seqs: int) -> int:
    """Rows of the block table: one per running sequence, and one for the waiting sequence that
    holds prefix pages while its admission is tried."""
    return max_num_seqs + 1


def page_hash(previous: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(previous + np.asarray(tokens, dtype="<i8").tobytes()).digest()


def _manager(spec: AttentionSpec, group: int, pool: PagePool, page_size: int) -> FullAttentionManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(group, pool, page_size, spec.window)
    return FullAttentionManager(group, pool, page_size)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 num_table_rows: int | None = None, group_specs: tuple[AttentionSpec, ...] = ONE_GROUP,
                 prefix_states: PrefixStates | None = None):
        """``group_specs``: each KV cache group's spec (``KVCacheLayout.group_specs``); ``prefix_states``:
        hybrid models' saved linear-attention states (a hit then ends where one is saved)."""
        self.num_pages, self.page_size = num_pages, page_size
        self.pool = PagePool(num_pages)
        self.group_specs = tuple(group_specs)
        self.managers = [_manager(spec, g, self.pool, page_size) for g, spec in enumerate(self.group_specs)]
        self.linear = LinearStateManager(prefix_states, page_size)
        # A window's pages at once grow with its chunk: chunks are then shortened to the free pages.
        self.chunks_shrink = any(m.frees_behind for m in self.managers)
        # A sequence holding pages holds at least one, so num_pages rows always suffice.
        self.num_table_rows = num_pages if num_table_rows is None else num_table_rows
        self.free_rows = list(range(self.num_table_rows - 1, -1, -1))
        self.table_writes: list[tuple[int, int, int, int]] = []  # (group, row, column, page), until taken
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_hits = 0   # tokens served from the cache, since start

    # ---- what the rest of the engine reads -----------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def page_of_hash(self) -> dict:
        """The findable pages by (group, prefix hash)."""
        return self.pool.page_of_hash

    @property
    def prefix_states(self) -> PrefixStates | None:
        return self.linear.states

    @property
    def prefill_boundary(self) -> int | None:
        """Prefill chunks end at the multiples of it they pass (None: where the budget does)."""
        return self.linear.prefill_boundary

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def pages_needed(self, num_tokens: int, chunk: int) -> int:
        """The most pages one sequence of ``num_tokens`` tokens holds at once, in all groups, its
        steps bringing at most ``chunk`` tokens each."""
        return sum(pages_held(spec, num_tokens, self.page_size, chunk) for spec in self.group_specs)

    def pages_to_run(self, num_tokens: int, max_chunk: int) -> int:
        """The fewest pages a request of ``num_tokens`` tokens needs to run alone: its windows' and one
        token's where chunks shrink to the free pages, else those of chunks of ``max_chunk`` tokens
        (full attention: its whole context either way)."""
        return self.pages_needed(num_tokens, 1 if self.chunks_shrink else max_chunk)

    def take_table_writes(self) -> list[tuple[int, int, int, int]]:
        """The block-table writes since the last call (the runner applies them in order)."""
        writes, self.table_writes = self.table_writes, []
        return writes

    # ---- one sequence's pages ----------------------------------------------------------------------

    def _hold(self, seq: Sequence) -> None:
        """Give the sequence its block-table row (and state slot), and a page list per group."""
        if seq.block_row is None:
            if not self.free_rows:
                raise InternalError(f"more than {self.num_table_rows} sequences hold KV pages")
            seq.block_row = self.free_rows.pop()
        if not seq.pages:
            seq.pages = [[] for _ in self.managers]

    def _add_page(self, seq: Sequence, group: int, page: int) -> None:
        pages = seq.pages[group]
        self.table_writes.append((group, seq.block_row, len(pages), page))
        pages.append(page)

    def _hash(self, seq: Sequence, j: int) -> bytes:
        """The hash of the sequence's page j (full), extending its chain as far as needed."""
        while len(seq.page_hashes) <= j:
            k = len(seq.page_hashes)
            previous = seq.page_hashes[-1] if k else seq.hash_seed
            first, end = k * self.page_size, (k + 1) * self.page_size
            if seq.prompt_inputs is not None:  # its inputs' salt for this page (the digests of its images)
                previous += seq.prompt_inputs.salt(first, end)
            seq.page_hashes.append(page_hash(previous, seq.token_ids[first:end]))
        return seq.page_hashes[j]

    def match_prefix(self, seq: Sequence) -> None:
        """For a sequence with nothing in the cache yet: take the cached pages of its longest cached
        prefix that every manager agrees on. At least one token is left to compute, so that the
        step yields its logits."""
        assert not seq.pages and seq.num_computed == 0
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return

        def hash_of(j: int) -> bytes:
            return self._hash(seq, j)
        matched, agreed = (seq.num_tokens - 1) // self.page_size, None
        while matched != agreed:  # a hit no manager shortens is one every manager takes
            agreed = matched
            for m in (*self.managers, self.linear):
                matched = m.longest_hit(matched, hash_of)
        if not matched:
            return
        self._hold(seq)
        for m in self.managers:
            m.take_hit(seq, matched, hash_of, self._add_page)
        seq.num_computed = seq.num_hashed_pages = matched
        seq.num_computed *= self.page_size
        self.prefix_hits += seq.num_computed
        self.linear.take_hit(matched, hash_of, seq.block_row)

    def pages_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        return sum(m.missing(seq, num_new_tokens) for m in self.managers)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pages_missing(seq, num_new_tokens) <= self.num_free

    def chunk_that_fits(self, seq: Sequence, count: int) -> int:
        """The sequence's next chunk of at most ``count`` tokens: all of them if their pages fit the
        free ones; else, where chunks shrink, the longest that fits, or one token if none does (the
        scheduler then preempts or waits, as for a chunk that does not shrink)."""
        if not self.chunks_shrink or self.can_allocate(seq, count):
            return count
        low, high = 1, count - 1  # the pages missing never decrease with the chunk
        while low < high:
            middle = (low + high + 1) // 2
            if self.can_allocate(seq, middle):
                low = middle
            else:
                high = middle - 1
        return low

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Pages for the sequence's next ``num_new_tokens`` tokens (call ``can_allocate`` first)."""
        for m in self.managers:
            missing = m.missing(seq, num_new_tokens)
            if missing:  # none, most decode steps
                self._hold(seq)
                for _ in range(missing):
                    self._add_page(seq, m.group, self.pool.take_free())

    def register_full_pages(self, seq: Sequence) -> None:
        """After a step: make the sequence's newly completed pages findable by their prefix, save
        its linear-attention state where one is saved, and free the pages its windows left."""
        if not seq.pages:
            return
        if self.enable_prefix_caching:
            full = seq.num_computed // self.page_size
            if seq.num_computed:
                self.linear.after_step(seq, lambda: self._hash(seq, full - 1), seq.block_row)
            for j in range(seq.num_hashed_pages, full):
                key = self._hash(seq, j)
                for g, pages in enumerate(seq.pages):
                    if pages[j] >= 0:
                        self.pool.register(pages[j], (g, key))
            seq.num_hashed_pages = max(seq.num_hashed_pages, full)
        for m in self.managers:
            m.free_unneeded(seq)

    def trim(self, seq: Sequence) -> None:
        """Free the sequence's pages past its computed positions (those of rejected proposals: never
        registered, since only pages its computed positions fill are). A sequence rolled back past
        pages its window freed is released whole, to be recomputed from its first token."""
        if not seq.pages:
            return
        if not all([m.trim(seq) for m in self.managers]):
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's pages (finished, aborted or preempted)."""
        if seq.pages:
            for m in self.managers:
                m.release(seq)
        seq.pages = []
        seq.num_computed = seq.num_hashed_pages = 0
        if seq.block_row is not None:  # its row's entries are never read again: a new owner writes its own
            self.free_rows.append(seq.block_row)
            seq.block_row = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (all must be free); returns how many were findable."""
        if self.num_used:
            raise EngineBusyError(f"{self.num_used} KV pages are in use")
        self.linear.clear()
        return self.pool.forget_cached()
