"""Pages of the KV cache: allocation, reference counts and prefix caching.

A page holds ``page_size`` consecutive positions of one sequence, and page_size is the attention
kernel's KV block, so a page never splits a block. A full page is identified by a hash chained
over the token ids of its sequence up to its end: the KV of a token depends only on the tokens
before it (and blocks are aligned to the sequence start), so two sequences with the same prefix
may share those pages and get bitwise the same attention (with images, the chain also takes the
digests of the images a page holds tokens of). Freed pages keep their hash and stay
findable until they are reused, least recently freed first.

The block table: each sequence holding pages owns a row of it (``seq.block_row``), and every page
appended to a sequence is logged as a write ``(row, column, page)`` in ``table_writes``, which the
model runner applies to its persistent copy on the device; no step rebuilds a sequence's row.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .sequence import Sequence
from ..errors import EngineBusyError, InternalError


def block_table_rows(max_num_seqs: int) -> int:
    """Rows of the block table: one per running sequence, and one for the waiting sequence that
    holds prefix pages while its admission is tried."""
    return max_num_seqs + 1


def page_hash(previous: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(previous + np.asarray(tokens, dtype="<i8").tobytes()).digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 num_table_rows: int | None = None, prefix_states=None):
        """``prefix_states``: for hybrid models, the saved linear-attention states (``PrefixStates``):
        a hit then ends where one is saved, and the sequence's slot gets it."""
        self.num_pages, self.page_size = num_pages, page_size
        # A sequence holding pages holds at least one, so num_pages rows always suffice.
        self.num_table_rows = num_pages if num_table_rows is None else num_table_rows
        self.free_rows = list(range(self.num_table_rows - 1, -1, -1))
        self.table_writes: list[tuple[int, int, int]] = []  # (row, column, page), until the runner takes them
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.hash_of: list[bytes | None] = [None] * num_pages
        self.page_of_hash: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((page, None) for page in range(num_pages))
        self.prefix_hits = 0   # tokens served from the cache, since start
        self.prefix_states = prefix_states

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _add_page(self, seq: Sequence, page: int) -> None:
        if seq.block_row is None:
            if not self.free_rows:
                raise InternalError(f"more than {self.num_table_rows} sequences hold KV pages")
            seq.block_row = self.free_rows.pop()
        self.table_writes.append((seq.block_row, len(seq.pages), page))
        seq.pages.append(page)

    def take_table_writes(self) -> list[tuple[int, int, int]]:
        """The block-table writes since the last call (the runner applies them in order)."""
        writes, self.table_writes = self.table_writes, []
        return writes

    def _take_free(self) -> int:
        page, _ = self.free.popitem(last=False)  # least recently freed
        old = self.hash_of[page]
        if old is not None:  # evict its cached content
            self.hash_of[page] = None
            if self.page_of_hash.get(old) == page:
                del self.page_of_hash[old]
        self.ref_counts[page] = 1
        return page

    def _hash(self, seq: Sequence, j: int) -> bytes:
        """The hash of the sequence's page j (full), extending its chain as far as needed."""
        while len(seq.page_hashes) <= j:
            k = len(seq.page_hashes)
            previous = seq.page_hashes[-1] if k else seq.hash_seed
            first, end = k * self.page_size, (k + 1) * self.page_size
            if seq.multimodal is not None:  # the digests of the images this page holds tokens of
                previous += seq.multimodal.page_key(first, end)
            seq.page_hashes.append(page_hash(previous, seq.token_ids[first:end]))
        return seq.page_hashes[j]

    def match_prefix(self, seq: Sequence) -> None:
        """For a sequence with nothing in the cache yet: take the cached pages of its longest
        cached prefix. At least one token is left to compute, so that the step yields its logits."""
        assert not seq.pages and seq.num_computed == 0
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return
        matched = 0
        while matched < (seq.num_tokens - 1) // self.page_size and self._hash(seq, matched) in self.page_of_hash:
            matched += 1
        states = self.prefix_states
        if states is not None:  # only up to a position whose linear-attention state is saved
            per = states.interval // self.page_size
            matched -= matched % per
            while matched and self._hash(seq, matched - 1) not in states:
                matched -= per
        for j in range(matched):
            page = self.page_of_hash[self._hash(seq, j)]
            if self.ref_counts[page] == 0:
                del self.free[page]
            self.ref_counts[page] += 1
            self._add_page(seq, page)
        seq.num_computed = seq.num_hashed_pages = len(seq.pages)
        seq.num_computed *= self.page_size
        self.prefix_hits += seq.num_computed
        if states is not None and matched:
            states.restore(self._hash(seq, matched - 1), seq.block_row)

    def pages_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        missing = -(-(seq.num_computed + num_new_tokens) // self.page_size) - len(seq.pages)
        return missing if missing > 0 else 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pages_missing(seq, num_new_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Pages for the sequence's next ``num_new_tokens`` tokens (call ``can_allocate`` first)."""
        for _ in range(self.pages_missing(seq, num_new_tokens)):  # none, most decode steps
            self._add_page(seq, self._take_free())

    def register_full_pages(self, seq: Sequence) -> None:
        """After a step: make the sequence's newly completed pages findable by their prefix."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed // self.page_size
        states = self.prefix_states
        if states is not None and seq.num_computed and seq.num_computed % states.interval == 0:
            states.save(self._hash(seq, full - 1), seq.block_row)
        if full <= seq.num_hashed_pages:
            return
        for j in range(seq.num_hashed_pages, full):
            page, page_hash_ = seq.pages[j], self._hash(seq, j)
            if self.hash_of[page] is None and page_hash_ not in self.page_of_hash:
                self.hash_of[page] = page_hash_
                self.page_of_hash[page_hash_] = page
        seq.num_hashed_pages = full

    def trim(self, seq: Sequence) -> None:
        """Free the sequence's pages past its computed positions (those of rejected proposals: never
        registered, since only pages its computed positions fill are)."""
        keep = self.pages_for(seq.num_computed)
        for page in reversed(seq.pages[keep:]):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free[page] = None
        del seq.pages[keep:]

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (all must be free); returns how many were findable."""
        if self.num_used:
            raise EngineBusyError(f"{self.num_used} KV pages are in use")
        dropped = len(self.page_of_hash)
        self.hash_of = [None] * self.num_pages
        self.page_of_hash.clear()
        if self.prefix_states is not None:
            self.prefix_states.clear()
        return dropped

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's pages (finished, aborted or preempted)."""
        for page in reversed(seq.pages):  # its last pages are the least likely to be shared
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free[page] = None
        seq.pages = []
        seq.num_computed = seq.num_hashed_pages = 0
        if seq.block_row is not None:  # its row's entries are never read again: a new owner writes its own
            self.free_rows.append(seq.block_row)
            seq.block_row = None
