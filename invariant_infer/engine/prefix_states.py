"""Prefix caching for hybrid models: a Gated DeltaNet layer keeps a state, not per-token KV, so a
prefix hit needs the layers' state at the end of the cached prefix. The engine saves it when a
sequence's computed tokens reach a multiple of ``interval`` (a multiple of the scan's chunk and of the
page size: the state is then a boundary state, with no unfinished rows), keyed by the prefix hash
of the page that ends there; a later sequence whose pages hit up to such a position gets that state
in its slot, which is the state its own prefill would have computed, bit for bit (the scan's chunks
start at each sequence's first token). Saved states are evicted least recently used first.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from ..kernels.gated_delta_rule import CHUNK


def saved_state_interval(page_size: int) -> int:
    """Positions where a state can be saved: chunk boundaries that are page boundaries too."""
    return math.lcm(CHUNK, page_size)


class PrefixStates:
    """Saved states by prefix hash. ``store`` copies them: ``save(slot, index)`` and
    ``restore(index, slot)`` (``QueuedStateCopies``, or ``LinearAttentionSlots`` itself)."""

    def __init__(self, store, capacity: int, interval: int):
        self.store, self.capacity, self.interval = store, capacity, interval
        self.index_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.free = list(range(capacity - 1, -1, -1))
        self.restored = 0  # states put in a sequence's slot, since start

    def __contains__(self, key: bytes) -> bool:
        return key in self.index_of

    def __len__(self) -> int:
        return len(self.index_of)

    def save(self, key: bytes, slot: int) -> None:
        if key in self.index_of:  # the same prefix: the same state
            self.index_of.move_to_end(key)
            return
        if self.free:
            index = self.free.pop()
        elif self.index_of:
            index = self.index_of.popitem(last=False)[1]
        else:
            return
        self.store.save(slot, index)
        self.index_of[key] = index

    def restore(self, key: bytes, slot: int) -> None:
        self.index_of.move_to_end(key)
        self.store.restore(self.index_of[key], slot)
        self.restored += 1

    def clear(self) -> None:
        self.free += self.index_of.values()
        self.index_of.clear()


SAVE, RESTORE = "save", "restore"


class QueuedStateCopies:
    """The store of the prefix cache's saved linear-attention states (``PrefixStates``) as the
    scheduler sees it: each copy waits for the next step, which applies it on every rank before
    its forward (under tensor parallelism each rank holds its own copy of the states)."""

    def __init__(self):
        self.pending: list[tuple[str, int, int]] = []

    def save(self, slot: int, index: int) -> None:
        self.pending.append((SAVE, slot, index))

    def restore(self, index: int, slot: int) -> None:
        self.pending.append((RESTORE, index, slot))
