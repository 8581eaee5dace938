"""The one pool of KV pages every KV cache group draws from (``kv_cache_layout``): reference counts,
the free list and the prefix cache's index.

A page is findable by ``(group, prefix hash)`` once registered: the same tokens cached in two groups
are two pages. Freed pages keep their key and stay findable until they are reused, least recently
freed first.
"""
from __future__ import annotations

from collections import OrderedDict

CacheKey = tuple[int, bytes]  # (group, prefix hash of the page's tokens)


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.hash_of: list[CacheKey | None] = [None] * num_pages
        self.page_of_hash: dict[CacheKey, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((page, None) for page in range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def take_free(self) -> int:
        """A free page (the least recently freed), its cached content evicted."""
        page, _ = self.free.popitem(last=False)
        old = self.hash_of[page]
        if old is not None:
            self.hash_of[page] = None
            if self.page_of_hash.get(old) == page:
                del self.page_of_hash[old]
        self.ref_counts[page] = 1
        return page

    def cached(self, key: CacheKey) -> int | None:
        return self.page_of_hash.get(key)

    def share(self, page: int) -> None:
        """One more holder of a cached page (out of the free list if it was free)."""
        if self.ref_counts[page] == 0:
            del self.free[page]
        self.ref_counts[page] += 1

    def register(self, page: int, key: CacheKey) -> None:
        """Make a full page findable (unless it already is, or another page holds the same key)."""
        if self.hash_of[page] is None and key not in self.page_of_hash:
            self.hash_of[page] = key
            self.page_of_hash[key] = page

    def release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free[page] = None

    def forget_cached(self) -> int:
        """Drop every page's key; returns how many were findable."""
        dropped = len(self.page_of_hash)
        self.hash_of = [None] * self.num_pages
        self.page_of_hash.clear()
        return dropped
