"""One serving-engine step's context: everything the decoder's layers read about the step, built
once on the host before the forward (the engine's model runner), read by every layer kind, never
changed during the forward.

    context = StepContext(attention=paged_batch, linear_attention=step, lora_groups=groups)
    with context.active():
        model.model(input_ids=..., position_ids=..., attention_mask=...)

* ``attention``: the packed tokens' paged-attention metadata per KV cache group and its ``attend``
  (``engine.paged_batch.PagedBatch``), read by the attention function of every attention layer;
* ``linear_attention``: the Gated DeltaNet layers' step over the engine's state slots
  (``LinearAttentionStep``, laid out by ``engine.linear_state_slots``), None without such layers;
* ``lora_groups``: (slot, long row indices into the packed tokens) per adapter, read by every
  projection holding adapter slots (``lora.SlotWeights``); rows in no group run the base model.

How it reaches the layers: ``active()`` sets a ``contextvars.ContextVar`` for the forward and resets
it in ``finally``; each layer reads ``current_step()``. Not a keyword through transformers'
``**kwargs``: the adapter-slot projections are ``nn.Linear`` replacements called with ``x`` alone,
so a keyword cannot reach them, and whether a keyword reaches the attention function and the Gated
DeltaNet layer is up to each family's modeling code and transformers version. A context variable
reaches every layer kind the same way in every family, belongs to the thread (and asyncio task)
that runs the forward, so a forward elsewhere never sees it, and is keyed by nothing. A captured
CUDA graph holds what the layers read during its capture, so a replay can change the contents
of the context's tensors but nothing else: the runner builds the attention metadata and LoRA rows as
views of its persistent buffers; a replayed decode step's host ints (max query and context lengths)
are its bucket's, and its Gated DeltaNet layout is computed inside the graph from those buffers
(``engine.decode_graphs``).

Without an active context (``model(...)``, ``generate``, scoring, training) the layers run their
padded or packed paths.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Protocol

import torch


class PagedAttention(Protocol):
    """A step's paged attention (``engine.paged_batch.PagedBatch``)."""

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [1, Hq, T, D], k/v [1, Hkv, T, D] -> [1, T, Hq, D]; writes the step's K/V to its pages."""


@dataclass(frozen=True, eq=False)
class LinearAttentionStep:
    """One engine step's layout: where each sequence's cached and new rows sit in the packed
    convolution and scan inputs (the engine's ``LinearAttentionSlots.step``), built before the
    forward. ``updates`` is the forward's output: each layer puts its new state there, and
    ``commit`` writes them to the slots once every layer has run."""
    slots: object            # the engine's LinearAttentionSlots: conv, state, rows per layer
    slot_ids: torch.Tensor   # long [S]
    fresh: torch.Tensor      # bool [S]: the sequence's state starts empty
    conv: dict               # total, history_at, new_at, tail_at, start, end, out_from
    scan: dict
    keep: torch.Tensor       # bool [S, HISTORY]: rows of the new unfinished chunk
    updates: dict            # layer -> its new (conv, state, rows) of the step's slots, until ``commit``

    def commit(self) -> None:
        """Write the step's new state into the slots, once the whole forward has run (a forward that
        fails leaves every slot as it was, so its sequences can run again)."""
        ids = self.slot_ids
        for layer, (conv, state, rows) in self.updates.items():
            self.slots.conv[layer].index_copy_(0, ids, conv)
            self.slots.state[layer].index_copy_(0, ids, state)
            self.slots.rows[layer].index_copy_(0, ids, rows)
        self.updates.clear()


@dataclass(frozen=True, eq=False)
class StepContext:
    """One engine step, as the decoder's layers see it (see the module's docstring)."""
    attention: PagedAttention
    linear_attention: LinearAttentionStep | None = None  # hybrid models: the Gated DeltaNet layers' step
    lora_groups: tuple[tuple[int, torch.Tensor], ...] = ()

    @contextlib.contextmanager
    def active(self):
        """This context for the forward run inside the ``with`` block."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("invariant_infer_step", default=None)


def current_step() -> StepContext | None:
    """The engine step whose forward is running here, or None outside one."""
    return _CURRENT.get()
