"""Every Gated DeltaNet layer's per-sequence state in a serving engine, in slots: the engine's
linear-attention state manager (``linear_state``) gives each sequence holding pages its block-table
row as slot, and padding rows a scratch slot. The model's step forward
(``invariant_infer.model.linear_attention``) reads and writes them through the step's
``LinearAttentionStep`` (in the step context), which ``step`` lays out before the forward, on the
device, from the step's metadata already copied there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.gated_delta_rule import CHUNK
from ..model.linear_attention import HISTORY
from ..model.step_context import LinearAttentionStep
from .linear_state import SAVE


@dataclass
class LinearAttentionSlots:
    """Every Gated DeltaNet layer's per-sequence state for a serving engine, in slots (the engine
    gives each running sequence one, and a scratch slot to its padding rows): per layer, the last
    K - 1 inputs of the convolution, the fp32 state at the last chunk boundary and the unfinished
    chunk's rows, right-aligned (how many: the sequence's computed tokens % CHUNK). Besides, saved
    states: the convolution's inputs and the state of a sequence at a chunk boundary (no unfinished
    rows), which ``restore`` puts in another sequence's slot (the engine's prefix caching)."""
    conv: dict[int, torch.Tensor]    # [slots, K - 1, conv_dim]
    state: dict[int, torch.Tensor]   # fp32 [slots, Hv, Dk, Dv]
    rows: dict[int, torch.Tensor]    # [slots, HISTORY, conv_dim + 2 Hv]
    saved_conv: dict[int, torch.Tensor]   # [saved, K - 1, conv_dim]
    saved_state: dict[int, torch.Tensor]  # fp32 [saved, Hv, Dk, Dv]
    kernel: int

    @classmethod
    def for_layers(cls, layers, num_slots: int, device, dtype, num_saved: int = 0) -> LinearAttentionSlots:
        """Zeroed slots (and ``num_saved`` saved states) for the ``linear_attn`` modules of ``layers``
        (the other layers have none)."""
        conv, state, rows, saved_conv, saved_state = {}, {}, {}, {}, {}
        kernel = 0
        for index, layer in enumerate(layers):
            gdn = getattr(layer, "linear_attn", None)
            if gdn is None:
                continue
            kernel = gdn.conv_kernel_size
            state_shape = (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
            conv[index] = torch.zeros(num_slots, kernel - 1, gdn.conv_dim, device=device, dtype=dtype)
            state[index] = torch.zeros(num_slots, *state_shape, device=device)
            rows[index] = torch.zeros(num_slots, HISTORY, gdn.conv_dim + 2 * gdn.num_v_heads, device=device,
                                      dtype=dtype)
            saved_conv[index] = torch.zeros(num_saved, kernel - 1, gdn.conv_dim, device=device, dtype=dtype)
            saved_state[index] = torch.zeros(num_saved, *state_shape, device=device)
        return cls(conv, state, rows, saved_conv, saved_state, kernel)

    @property
    def nbytes(self) -> int:
        tensors = (self.conv, self.state, self.rows, self.saved_conv, self.saved_state)
        return sum(t.numel() * t.element_size() for d in tensors for t in d.values())

    def save(self, slot: int, index: int) -> None:
        """Copy the state of the sequence in ``slot`` (at a chunk boundary) to saved state ``index``."""
        for layer in self.conv:
            self.saved_conv[layer][index].copy_(self.conv[layer][slot])
            self.saved_state[layer][index].copy_(self.state[layer][slot])

    def restore(self, index: int, slot: int) -> None:
        """Put saved state ``index`` in ``slot``: its sequence continues from that chunk boundary."""
        for layer in self.conv:
            self.conv[layer][slot].copy_(self.saved_conv[layer][index])
            self.state[layer][slot].copy_(self.saved_state[layer][index])

    def copy_states(self, state_copies) -> None:
        """Apply queued state copies (``linear_state``: save a slot's state, or restore a saved one), in order."""
        for kind, source, target in state_copies:
            (self.save if kind == SAVE else self.restore)(source, target)

    def step_of(self, state_copies, table_rows: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor,
                tokens: int, num_table_rows: int) -> LinearAttentionStep:
        """Apply the step's queued state copies (``linear_state``), then lay out its step from its
        metadata on the device (long: each sequence's block-table row [S], query starts [S + 1],
        context lengths [S]; ``tokens`` packed in all): each sequence's slot is its block-table row;
        padding rows (rows past ``num_table_rows``) and sequences with nothing computed start from
        an empty state."""
        self.copy_states(state_copies)
        query_lens = query_starts[1:] - query_starts[:-1]
        computed = seq_lens - query_lens
        fresh = (computed == 0) | (table_rows >= num_table_rows)
        return self.step(table_rows, computed, query_lens, fresh, tokens)

    def step(self, slot_ids: torch.Tensor, computed: torch.Tensor, query_lens: torch.Tensor, fresh: torch.Tensor,
             tokens: int) -> LinearAttentionStep:
        """The layout of one step whose sequence s (slot ``slot_ids[s]``, ``computed[s]`` tokens
        before this step, ``fresh[s]``: its state starts empty) brings ``query_lens[s]`` tokens,
        packed in that order (``tokens`` in all; long and bool [S] device tensors). A few small
        device ops, the same for every layer."""
        slots, done, n, fresh_mask = slot_ids, computed, query_lens, fresh
        device = slots.device
        offset = torch.arange(tokens, device=device) - torch.repeat_interleave(n.cumsum(0) - n, n,
                                                                                output_size=tokens)

        def layout(history: int):
            width = history + n
            base = width.cumsum(0) - width
            span = torch.arange(history, device=device)
            return dict(total=tokens + history * len(slot_ids), history_at=(base[:, None] + span).flatten(),
                        new_at=torch.repeat_interleave(base + history, n, output_size=tokens) + offset,
                        tail_at=(base + width - history)[:, None] + span, start=base, end=base + width,
                        out_from=base + history)
        count = torch.where(fresh_mask, 0, done % CHUNK)
        scan = layout(HISTORY)
        scan["start"] = scan["out_from"] - count
        keep = torch.arange(HISTORY, device=device)[None, :] >= HISTORY - ((count + n) % CHUNK)[:, None]
        return LinearAttentionStep(self, slots, fresh_mask, layout(self.kernel - 1), scan, keep, {})
