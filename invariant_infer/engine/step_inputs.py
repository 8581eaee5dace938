"""One engine step as the model runner packs it: ``StepMetadata``, the scheduled chunks' tokens,
positions and pages as plain lists (built on rank 0, sent to the other ranks under tensor
parallelism), and ``StepInputs``, what one forward reads once the metadata sits in the runner's
persistent buffers."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.step_context import StepContext


@dataclass
class StepMetadata:
    """One step's packed tokens and pages, as plain lists (what rank 0 sends the other ranks)."""
    ids: list[int]
    positions: list[int]
    slots: list[int]               # per KV cache group, each token's page * page_size + offset (group-major)
    query_starts: list[int]
    seq_lens: list[int]
    table_rows: list[int]          # each sequence's row of the persistent block tables (one per KV cache group)
    table_width: int               # pages of the longest sequence
    table_writes: list[tuple[int, int, int, int]]  # (group, row, column, page) to apply first (kv_cache_manager.py)
    num_real_tokens: int
    lora_groups: list = field(default_factory=list)  # (slot, packed rows) per LoRA adapter (engine.lora_slots)
    # The prefix cache's linear-attention state copies to apply first, in order (linear_state.py).
    state_copies: list[tuple[str, int, int]] = field(default_factory=list)
    # A rope of several axes: positions [axes * T], axis-major; (packed offset, overrides) per chunk with some.
    positions_by_axis: list[int] | None = None
    embedding_overrides: list = field(default_factory=list)
    graph_bucket: int = 0          # a decode step replayed as its bucket's CUDA graph (fixed shapes); 0: eager


@dataclass
class StepInputs:
    """What one forward reads: views of the runner's persistent buffers."""
    input_ids: torch.Tensor        # long [1, T]
    position_ids: torch.Tensor     # long [1, T]
    context: StepContext           # what the layers read during the forward
    num_real_tokens: int           # the first rows; padding rows follow
    metadata: StepMetadata | None = field(default=None, repr=False)
