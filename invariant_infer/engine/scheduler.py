"""Continuous batching: which sequences run in the next step, and how many of their tokens.

First come, first served. Each step has a token budget (``max_num_batched_tokens``) and a
sequence cap (``max_num_seqs``). Running sequences go first (a decode token, or the next chunk
of a prefill), then waiting ones are admitted while budget and pages last (counted per KV cache
group: a windowed group holds only its window's pages, ``kv_cache_manager``); a prefill longer than
what is left of the budget runs in chunks over several steps, mixed with other sequences' decode
tokens. Under windows a chunk is also shortened to what the free pages hold, and the window frees
its pages between chunks, so a long prompt runs within its windows' pages whatever the budget.
When pages run out, the most recently admitted sequence is preempted: its pages are
freed and it is recomputed later from its tokens, which gives bitwise the same KV.
None of this can change a bit of any result: every kernel computes a token from its own
sequence alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int        # first position computed in this step
    num_tokens: int   # positions [start, start + num_tokens), the draft's included
    draft: list[int] = field(default_factory=list)  # proposals after the sequence's last token: the last rows

    @property
    def completes(self) -> bool:
        """The chunk reaches the sequence's last token, so its last row(s) yield the next token(s)."""
        return self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        tokens = self.seq.token_ids[self.start:self.start + self.num_tokens - len(self.draft)]
        return tokens + self.draft if self.draft else tokens


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 admission=None):
        """``admission``: whatever else a waiting sequence needs before it runs, an object whose
        ``can_admit(seq, running)`` says whether it has it (the engine's LoRA slots: a slot for its
        adapter); None: nothing else. A chunk ends where the budget does, or under windows where the
        free pages do (``KVCacheManager.chunk_that_fits``); one that passes a multiple of the cache's
        ``prefill_boundary`` then ends at the last one it reaches (the linear-attention state manager
        saves states there only)."""
        self.blocks = kv_cache
        self.admission = admission
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt_latest(self) -> Sequence | None:
        """Free the pages of the most recently admitted running sequence and put it first in the
        waiting queue (it is recomputed from its tokens); returns it, or None if none runs."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self.blocks.release(victim)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def _add_proposals(self, chunks: list[ScheduledChunk], budget: int) -> int:
        """Extend each running sequence's decode chunk by the proposals the budget and the free pages
        still hold (arrival order), after every running sequence has its own token: proposals never
        preempt a sequence or take another's token. Returns the budget left."""
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if budget == 0 or not seq.draft_ids or not chunk.completes:
                continue
            extra = min(len(seq.draft_ids), budget)
            while extra and not self.blocks.can_allocate(seq, chunk.num_tokens + extra):
                extra -= 1  # verify fewer proposals
            if extra:
                self.blocks.allocate(seq, chunk.num_tokens + extra)
                chunks[i] = ScheduledChunk(seq, chunk.start, chunk.num_tokens + extra, seq.draft_ids[:extra])
                budget -= extra
        return budget

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        count = self.blocks.chunk_that_fits(seq, min(seq.num_tokens - seq.num_computed, budget))
        boundary = self.blocks.prefill_boundary
        if boundary:
            start = seq.num_computed
            last = (start + count) // boundary * boundary  # the last multiple the chunk reaches
            if start < last < start + count:
                count = last - start
        return count

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted below to make room for an earlier one
                continue
            count = self._chunk_size(seq, budget)
            while not self.blocks.can_allocate(seq, count):
                if self.preempt_latest() is seq:
                    break
                count = self._chunk_size(seq, budget)  # the victim's pages may hold a longer chunk
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.allocate(seq, count)
            chunks.append(ScheduledChunk(seq, seq.num_computed, count))
            budget -= count
        budget = self._add_proposals(chunks, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.admission is not None and not self.admission.can_admit(seq, self.running):
                break
            if not seq.pages:
                self.blocks.match_prefix(seq)
            count = self._chunk_size(seq, budget)
            if not self.blocks.can_allocate(seq, count):
                self.blocks.release(seq)  # give back any prefix pages it took; it retries next step
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, count)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, count))
            budget -= count
        return chunks
