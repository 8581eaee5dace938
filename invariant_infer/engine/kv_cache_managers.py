"""One manager per KV cache group (``kv_cache_layout``), by its spec's kind: which pages of a
sequence the group holds, which of its cached pages a prefix hit may take, and which it frees.

A sequence's pages in group g are ``seq.pages[g]``: column j holds positions [j*P, (j+1)*P), or
``NO_PAGE`` where the group holds none (a window's pages it has left, or never needed after a hit).

Every manager answers the coordinator (``kv_cache_manager``) through the same methods; the kinds
differ in what they hold, not in how they are asked:

* ``FullAttentionManager``: every page of the sequence, from its first position. A prefix hit of m
  pages needs pages 0 .. m-1 cached: its longest hit is the run of cached pages from the first.
* ``SlidingWindowManager`` (window w): a query at position p sees keys (p - w, p], so the next
  chunk, starting at ``num_computed``, reads no page before column (num_computed - w + 1) // P.
  Those pages are freed after each step (they stay findable in the prefix cache until reused). The
  paged attention kernel starts each query tile's walk at ``first_window_block`` of its first query,
  never below that column, so a freed page's stale table entry is never loaded. A prefix hit of m
  pages needs only the window's pages before position m*P to be cached. The pages it holds at once
  grow with the chunk (``frees_behind``): the scheduler shortens a chunk to what the free pages hold.
"""
from __future__ import annotations

from .page_pool import PagePool
from .sequence import Sequence

NO_PAGE = -1


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class FullAttentionManager:
    frees_behind = False  # whether pages are freed behind the sequence as it advances

    def __init__(self, group: int, pool: PagePool, page_size: int):
        self.group, self.pool, self.page_size = group, pool, page_size

    def first_needed(self, position: int) -> int:
        """The first column a chunk starting at ``position`` reads."""
        return 0

    def missing(self, seq: Sequence, num_new_tokens: int) -> int:
        pages = seq.pages[self.group] if seq.pages else ()
        missing = pages_for(seq.num_computed + num_new_tokens, self.page_size) - len(pages)
        return missing if missing > 0 else 0

    def _cached(self, hash_of, j: int) -> bool:
        return self.pool.cached((self.group, hash_of(j))) is not None

    def longest_hit(self, limit: int, hash_of) -> int:
        """The most pages, at most ``limit``, a prefix hit may take in this group: every page before
        it cached (``hash_of(j)``: the prefix hash of the sequence's page j)."""
        run = 0
        while run < limit and self._cached(hash_of, run):
            run += 1
        return run

    def take_hit(self, seq: Sequence, matched: int, hash_of, add_page) -> None:
        """Take the cached pages a hit of ``matched`` pages reads; NO_PAGE before them."""
        first = self.first_needed(matched * self.page_size)
        seq.pages[self.group] += [NO_PAGE] * first
        for j in range(first, matched):
            page = self.pool.cached((self.group, hash_of(j)))
            self.pool.share(page)
            add_page(seq, self.group, page)

    def free_unneeded(self, seq: Sequence) -> None:
        """Free the pages the sequence's next chunk no longer reads (none under full attention)."""

    def trim(self, seq: Sequence) -> bool:
        """Free the pages past the computed positions; False if a page the next chunk reads was
        freed (the sequence must then be recomputed)."""
        pages = seq.pages[self.group]
        keep = pages_for(seq.num_computed, self.page_size)
        for page in reversed(pages[keep:]):
            if page != NO_PAGE:
                self.pool.release(page)
        del pages[keep:]
        first = self.first_needed(seq.num_computed)
        return all(page != NO_PAGE for page in pages[first:])

    def release(self, seq: Sequence) -> None:
        for page in reversed(seq.pages[self.group]):  # its last pages are the least likely to be shared
            if page != NO_PAGE:
                self.pool.release(page)


class SlidingWindowManager(FullAttentionManager):
    frees_behind = True

    def __init__(self, group: int, pool: PagePool, page_size: int, window: int):
        super().__init__(group, pool, page_size)
        self.window = window

    def first_needed(self, position: int) -> int:
        return max(0, position - self.window + 1) // self.page_size

    def longest_hit(self, limit: int, hash_of) -> int:
        """The most pages, at most ``limit``, whose window before them is cached: from the longest
        down, a page found missing rules out every hit after it."""
        matched = limit
        while matched:
            first, j = self.first_needed(matched * self.page_size), matched - 1
            while j >= first and self._cached(hash_of, j):
                j -= 1
            if j < first:
                return matched
            matched = j  # every hit past j reads page j (first_needed never decreases)
        return 0

    def free_unneeded(self, seq: Sequence) -> None:
        pages = seq.pages[self.group]
        j = min(self.first_needed(seq.num_computed), len(pages)) - 1
        while j >= 0 and pages[j] != NO_PAGE:  # the freed columns are a prefix: stop at the first
            self.pool.release(pages[j])
            pages[j] = NO_PAGE
            j -= 1
