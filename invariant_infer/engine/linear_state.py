"""The engine's linear-attention state manager (Gated DeltaNet layers of hybrid models): a state slot
per sequence holding pages (its block-table row: ``LinearAttentionSlots``), and the prefix cache's
saved states.

A Gated DeltaNet layer keeps a state, not per-token KV, so a prefix hit needs the layers' state at
the end of the cached prefix. The engine saves it when a sequence's computed tokens reach a multiple
of ``interval`` (a multiple of the scan's chunk and of the page size: the state is then a boundary
state, with no unfinished rows), keyed by the prefix hash of the page that ends there; a later
sequence whose pages hit up to such a position gets that state in its slot, which is the state its
own prefill would have computed, bit for bit (the scan's chunks start at each sequence's first
token). Saved states are evicted least recently used first. Prefill chunks end at the multiples of
``interval`` they pass (``prefill_boundary``), so that a state is saved there.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from ..kernels.gated_delta_rule import CHUNK
from .sequence import Sequence


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


class LinearStateManager:
    """The linear-attention layers' part of the KV cache manager: slots are block-table rows (the
    coordinator's), so this manager holds no pages; with prefix caching, ``states`` saves and
    restores states at multiples of ``states.interval`` (None: a model without such layers, or
    prefix caching off, whose hits are then never tried)."""

    def __init__(self, states: PrefixStates | None, page_size: int):
        self.states, self.page_size = states, page_size

    @property
    def prefill_boundary(self) -> int | None:
        return self.states.interval if self.states is not None else None

    def longest_hit(self, limit: int, hash_of) -> int:
        """The most pages, at most ``limit``, a prefix hit may take: it ends where a state is saved
        (``hash_of(j)``: the prefix hash of the sequence's page j); any, without linear-attention layers."""
        states = self.states
        if states is None:
            return limit
        step = states.interval // self.page_size  # the interval is a multiple of the page size
        matched = limit // step * step
        while matched and hash_of(matched - 1) not in states:
            matched -= step
        return matched

    def take_hit(self, matched: int, hash_of, slot: int) -> None:
        """Restore the state saved where a hit of ``matched`` pages ends into the sequence's slot."""
        if matched and self.states is not None:
            self.states.restore(hash_of(matched - 1), slot)

    def after_step(self, seq: Sequence, last_key, slot: int) -> None:
        """Save the sequence's state if its computed tokens end at a multiple of the interval."""
        states = self.states
        if states is not None and seq.num_computed and seq.num_computed % states.interval == 0:
            states.save(last_key(), slot)

    def clear(self) -> None:
        if self.states is not None:
            self.states.clear()
