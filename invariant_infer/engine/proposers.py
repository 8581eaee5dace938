"""Where speculative proposals come from. A proposer's numerics only decide how many proposals are
accepted, never a token or logprob (``speculative`` verifies each one exactly).

``NgramProposer``: prompt lookup, no model. ``DraftModelProposer``: a smaller causal LM with the
target's vocabulary, greedy, over its own KV pages (its own KV cache manager, no prefix cache): each
sequence keeps a copy there, rolled back to what it shares with the target's tokens before each step.
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from ..model.patch import is_invariant, make_invariant
from .kv_cache_layout import kv_cache_layout
from .kv_cache_manager import KVCacheManager, block_table_rows
from .model_runner import ModelRunner
from .scheduler import ScheduledChunk
from .sequence import Sequence
from ..errors import InvalidArgumentError


def prompt_lookup(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the last n tokens (the latest with k
    tokens after it, else the earliest), for the largest n in [low, high] that occurs; [] if none."""
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(high, len(ids) - 1), low - 1, -1):
        windows = sliding_window_view(ids[:-1], n)  # each has a token after it
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            whole = hits[hits + n + k <= len(ids)]  # the latest with k tokens after it, else the earliest
            start = int(whole[-1] if whole.size else hits[0]) + n
            return ids[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def release(self, request_id: str) -> None:
        """Nothing is kept per sequence."""

    def propose(self, wanted: list[tuple[Sequence, int]], running) -> list[tuple[Sequence, list[int]]]:
        drafts = [(seq, prompt_lookup(seq.token_ids, room, self.low, self.high)) for seq, room in wanted]
        return [(seq, draft) for seq, draft in drafts if draft]


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


class DraftModelProposer:
    def __init__(self, draft, *, invariant: bool, num_positions: int, kv_cache_memory: int | None,
                 max_num_seqs: int, max_num_batched_tokens: int):
        if invariant and not is_invariant(draft):
            make_invariant(draft)
        config = draft.config
        head = draft.get_output_embeddings().weight
        page_size = ModelRunner.page_size_for(config, head.device, head.dtype)
        self.max_positions = config.max_position_embeddings
        layout = kv_cache_layout(config)
        if kv_cache_memory is not None:
            num_pages = kv_cache_memory // layout.page_bytes(head.dtype, page_size)
        else:  # as many positions as the target's cache holds, in each KV cache group
            num_pages = -(-num_positions // page_size) * len(layout.groups)
        num_pages = min(num_pages, max_num_seqs * sum(layout.pages_for_request(self.max_positions, page_size,
                                                                               max_num_batched_tokens)))
        if num_pages < 1:
            raise InvalidArgumentError(f"draft_kv_cache_memory={kv_cache_memory} bytes holds no page of the draft "
                                       "model")
        self.budget = max(max_num_batched_tokens, max_num_seqs)
        self.runner = ModelRunner(draft.eval(), num_pages=num_pages, page_size=page_size, invariant=invariant,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=self.budget)
        self.blocks = KVCacheManager(num_pages, page_size, enable_prefix_caching=False,
                                     num_table_rows=block_table_rows(max_num_seqs),
                                     group_specs=layout.group_specs)
        self.copies: dict[str, Sequence] = {}  # request id -> its tokens and KV pages in the draft's cache
        self.num_forwards = 0

    def release(self, request_id: str) -> None:
        """Free the sequence's copy (finished); an aborted one's goes at the next proposal."""
        copy = self.copies.pop(request_id, None)
        if copy is not None:
            self.blocks.release(copy)

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's copy of ``seq``, its KV kept only where its tokens are still the target's. The
        copy's prompt is the target's tokens, its outputs its proposals; only the tokens after the
        last sync are compared and copied (a sequence's tokens are only ever appended)."""
        copy = self.copies.get(seq.request_id)
        if copy is None:
            copy = self.copies[seq.request_id] = Sequence(seq.request_id, [], seq.params, 0, 0)
        tokens, synced = seq.token_ids, copy.num_prompt_tokens
        same = synced + shared_prefix(copy.token_ids[synced:], tokens[synced:len(copy.token_ids)])
        # Its last token's logits are needed, so its KV is recomputed even when no token came since.
        copy.num_computed = min(copy.num_computed, same, len(tokens) - 1)
        copy.truncate(same)
        copy.token_ids += tokens[same:]
        copy.num_prompt_tokens = len(tokens)
        self.blocks.trim(copy)
        return copy

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Sequence, int]], running) -> list[tuple[Sequence, list[int]]]:
        live = {seq.request_id for seq in running}
        for request_id in [r for r in self.copies if r not in live]:
            self.release(request_id)  # finished, aborted, or no longer running
        active = []
        for seq, room in wanted:
            room = min(room, self.max_positions - seq.num_tokens)
            if room > 0:
                active.append((seq, self._sync(seq), room))
        results = [(seq, copy) for seq, copy, _ in active]
        while active:  # catch-up chunks, then one token per copy and forward
            chunks, budget, kept = [], self.budget, []
            for seq, copy, room in active:
                count = min(copy.num_tokens - copy.num_computed, budget)
                if count and not self.blocks.can_allocate(copy, count):  # the draft's cache is full
                    self.release(seq.request_id)
                    continue
                kept.append((seq, copy, room))
                if count:
                    self.blocks.allocate(copy, count)
                    chunks.append(ScheduledChunk(copy, copy.num_computed, count))
                    budget -= count
            if not chunks:
                break
            hidden = self.runner.forward(self.runner.prepare(chunks, self.blocks.take_table_writes()))
            self.num_forwards += 1
            ends, offset = [], 0
            for chunk in chunks:
                offset += chunk.num_tokens
                chunk.seq.num_computed += chunk.num_tokens
                if chunk.completes:
                    ends.append((offset - 1, chunk.seq))
            if ends:
                tokens = self.runner.logits_of(hidden, [row for row, _ in ends]).float().argmax(-1).tolist()
                for (_, copy), token in zip(ends, tokens):
                    copy.append_token(token)
            active = [(seq, copy, room) for seq, copy, room in kept if copy.num_output_tokens < room]
        return [(seq, list(copy.output_ids)) for seq, copy in results
                if copy.num_output_tokens and seq.request_id in self.copies]
