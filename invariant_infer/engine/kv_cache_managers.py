"""One manager per KV cache group (``kv_cache_layout``), by its spec's kind: which pages of a
sequence the group holds, which of its cached pages a prefix hit may take, and which it frees.

A sequence's pages in group g are ``seq.pages[g]``: column j holds positions [j*P, (j+1)*P), or
``NO_PAGE`` where the group holds none (a window's pages it has left, or never needed after a hit).

* ``FullAttentionManager``: every page of the sequence, from its first position.
* ``SlidingWindowManager`` (window w): a query at position p sees keys (p - w, p], so the next
  chunk, starting at ``num_computed``, reads no page before column (num_computed - w + 1) // P.
  Those pages are freed after each step (they stay findable in the prefix cache until reused). The
  paged attention kernel starts each query tile's walk at ``first_window_block`` of its first query,
  never below that column, so a freed page's stale table entry is never loaded. A prefix hit of m
  pages needs only the window's pages before position m*P to be cached.
"""
from __future__ import annotations

from .page_pool import PagePool
from .sequence import Sequence

NO_PAGE = -1


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class FullAttentionManager:
    def __init__(self, group: int, pool: PagePool, page_size: int):
        self.group, self.pool, self.page_size = group, pool, page_size

    def first_needed(self, position: int) -> int:
        """The first column a chunk starting at ``position`` reads."""
        return 0

    def missing(self, seq: Sequence, num_new_tokens: int) -> int:
        pages = seq.pages[self.group] if seq.pages else ()
        missing = pages_for(seq.num_computed + num_new_tokens, self.page_size) - len(pages)
        return missing if missing > 0 else 0

    def hit_at(self, seq: Sequence, matched: int, key_of) -> bool:
        """Whether a hit of ``matched`` pages has every page this group reads after it cached
        (``key_of(j)``: the cache key of the sequence's page j in this group)."""
        return all(self.pool.cached(key_of(j)) is not None for j in range(self.first_needed(matched * self.page_size),
                                                                           matched))

    def take_hit(self, seq: Sequence, matched: int, key_of, add_page) -> None:
        """Take the cached pages a hit of ``matched`` pages reads; NO_PAGE before them."""
        first = self.first_needed(matched * self.page_size)
        seq.pages[self.group] += [NO_PAGE] * first
        for j in range(first, matched):
            page = self.pool.cached(key_of(j))
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
    def __init__(self, group: int, pool: PagePool, page_size: int, window: int):
        super().__init__(group, pool, page_size)
        self.window = window

    def first_needed(self, position: int) -> int:
        return max(0, position - self.window + 1) // self.page_size

    def free_unneeded(self, seq: Sequence) -> None:
        pages = seq.pages[self.group]
        j = min(self.first_needed(seq.num_computed), len(pages)) - 1
        while j >= 0 and pages[j] != NO_PAGE:  # the freed columns are a prefix: stop at the first
            self.pool.release(pages[j])
            pages[j] = NO_PAGE
            j -= 1
