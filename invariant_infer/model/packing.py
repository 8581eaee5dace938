"""Padding-free (packed) batches: several sequences concatenated in a row, as
``transformers.DataCollatorWithFlattening`` builds them.

A packed row carries no attention_mask; its ``position_ids`` restart at 0 where each sequence
starts (and/or ``cu_seq_lens_q/k`` give the boundaries over the flattened tokens). Attention
regroups the tokens into one right-padded row per sequence, [sequences, longest], runs the
kernel on that batch with the bounds each sequence has alone (kv_start 0, kv_end = its length,
q_start 0) and puts the outputs back in packed order, so each sequence reduces over exactly the
KV blocks it walks alone. Regrouping is a pure gather both ways (forward and backward), so it
moves values without arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NonInvariantInputError

# The keyword the base model's pre-hook adds to the forward; transformers passes it down to
# every attention call.
PACKED_KWARG = "packed_sequences"
# The keywords DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds.
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _Take(torch.autograd.Function):
    """``cat([x, 0])[index]`` along dim 0, whose backward is ``cat([grad, 0])[inverse]``: with each
    real row of x taken exactly once, both directions copy values and add nothing."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(index, inverse)
        return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])[index]

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        return _Take.apply(grad, inverse, index), None, None


@dataclass(frozen=True)
class PackedSequences:
    """Where each packed token goes in the regrouped [sequences, width] batch, and back."""
    batch: int                  # packed rows B
    length: int                 # columns T of a packed row
    sequences: int              # S
    width: int                  # longest sequence: the regrouped batch's row length
    token_slots: torch.Tensor   # long [B * T]: slot s * width + position of each token
    slot_tokens: torch.Tensor   # long [S * width]: token of each slot, B * T for padding slots
    lengths: torch.Tensor       # int32 [S]

    def bounds(self) -> torch.Tensor:
        """int32 [3, S, 1, 1] kv_start, kv_end, q_start of the regrouped batch (``padding.sequence_bounds``' layout)."""
        zeros = torch.zeros_like(self.lengths)
        return torch.stack([zeros, self.lengths, zeros])[:, :, None, None]

    def regroup(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] (packed) -> [S, H, width, D] (one sequence per row, zeros after its end)."""
        _, heads, _, dim = x.shape
        flat = x.transpose(1, 2).reshape(self.batch * self.length, heads, dim)
        rows = _Take.apply(flat, self.slot_tokens, self.token_slots)
        return rows.view(self.sequences, self.width, heads, dim).transpose(1, 2)

    def ungroup(self, out: torch.Tensor) -> torch.Tensor:
        """[S, width, H, D] (attention output) -> [B, T, H, D] contiguous, in packed order."""
        _, _, heads, dim = out.shape
        flat = out.reshape(self.sequences * self.width, heads, dim)
        tokens = _Take.apply(flat, self.token_slots, self.slot_tokens)
        return tokens.view(self.batch, self.length, heads, dim)


def _as_tensor(value, device) -> torch.Tensor:
    return torch.as_tensor(value, device=device).reshape(-1).to(torch.long)


def _positions_from_cu(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each of ``total`` flattened tokens within its sequence (cu clamped; checked elsewhere)."""
    token = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:].clamp(0, total), token, right=True).clamp(max=cu.numel() - 1)
    return token - cu[seq]


def resolve_packed(position_ids: torch.Tensor | None, flash_kwargs: dict, *, batch: int, length: int,
                   cache_length: int, max_positions: int, device: torch.device
                   ) -> tuple[torch.Tensor | None, PackedSequences | None]:
    """(position_ids, layout) of a forward without an attention_mask; layout is None unless packed.

    Packed means position_ids restart (a token whose position is not its predecessor's + 1) or
    ``cu_seq_lens_*`` are given. Checks, with one host sync: positions of real tokens lie in
    [0, max_positions); when packed, every row starts at 0, a position is either 0 (a new
    sequence) or its predecessor's + 1, no KV cache holds earlier tokens, and the flash kwargs
    agree with position_ids (cu_seq_lens_q == cu_seq_lens_k == the sequence starts over the
    flattened B * T tokens, then B * T; max_length_q == max_length_k == the longest sequence).
    Without position_ids, ``cu_seq_lens_*`` give them (0, 1, ... within each sequence)."""
    given = {name: flash_kwargs[name] for name in FLASH_KWARGS if flash_kwargs.get(name) is not None}
    if position_ids is None and not given:
        if cache_length + length > max_positions:
            raise NonInvariantInputError(f"sequence of {cache_length + length} positions is longer than "
                                         f"max_position_embeddings ({max_positions})")
        return None, None
    total = batch * length
    if total == 0:
        return position_ids, None
    cu = None
    if "cu_seq_lens_q" in given or "cu_seq_lens_k" in given:
        cu_q = _as_tensor(given.get("cu_seq_lens_q", given.get("cu_seq_lens_k")), device)
        cu_k = _as_tensor(given.get("cu_seq_lens_k", cu_q), device)
        if cu_q.shape != cu_k.shape or cu_q.numel() < 2:
            raise NonInvariantInputError(f"cu_seq_lens_q {tuple(cu_q.shape)} and cu_seq_lens_k {tuple(cu_k.shape)} "
                                         "must be equal 1-D boundaries [0, ..., total tokens]")
        cu = cu_q
    elif given:
        raise NonInvariantInputError("max_length_q/max_length_k need cu_seq_lens_q/cu_seq_lens_k")
    if position_ids is None:
        positions = _positions_from_cu(cu, total).view(batch, length)
    else:
        positions = position_ids.to(device=device, dtype=torch.long).expand(batch, -1)
    flat = positions.reshape(-1)
    starts = flat == 0
    row_first = torch.arange(total, device=flat.device) % length == 0
    follows = torch.cat([flat.new_zeros(1, dtype=torch.bool), flat[1:] == flat[:-1] + 1]) & ~row_first
    false = torch.zeros((), dtype=torch.bool, device=flat.device)
    cu_bad = false
    if cu is not None:
        index = cu[:-1].clamp(0, max(total - 1, 0))
        cu_bad = (cu[0] != 0) | (cu[-1] != total) | (cu.diff() <= 0).any() | ~starts[index].all() \
            | (starts.sum() != cu.numel() - 1) | (cu != cu_k).any()
    stats = torch.stack([
        ((flat != 0) & ~follows).any().long(),            # a token neither starts a sequence nor continues one
        (~follows & ~row_first).any().long(),             # a sequence starts inside a row
        ((flat < 0) | (flat >= max_positions)).any().long(),
        cu_bad.long(),
        starts.sum(),
        flat.max() + 1,
    ]).tolist()  # the one host sync
    broken, restarts, out_of_range, cu_mismatch, sequences, width = stats
    if out_of_range:
        raise NonInvariantInputError(f"position ids must lie in [0, {max_positions}) (max_position_embeddings)")
    if not (restarts or cu is not None):
        return position_ids, None
    if broken:
        raise NonInvariantInputError(
            "packed position_ids must start at 0 in every row and, inside a row, either restart at 0 (a new "
            "sequence) or increase by 1, as DataCollatorWithFlattening builds them")
    if cache_length:
        raise NonInvariantInputError("packed sequences cannot continue a KV cache; run packed forwards without "
                                     "cache contents (generation pads instead)")
    if cu_mismatch:
        raise NonInvariantInputError("cu_seq_lens_q/cu_seq_lens_k disagree with position_ids: they must both be "
                                     "[0, start of each sequence..., total tokens] over the flattened rows")
    for name in ("max_length_q", "max_length_k"):
        if name in given and int(given[name]) != width:
            raise NonInvariantInputError(f"{name}={int(given[name])} but the longest packed sequence has {width} "
                                         "tokens")
    seq = starts.cumsum(0) - 1
    token_slots = seq * width + flat
    slot_tokens = torch.full((sequences * width,), total, dtype=torch.long, device=flat.device)
    slot_tokens.scatter_(0, token_slots, torch.arange(total, device=flat.device))
    lengths = torch.zeros(sequences, dtype=torch.int32, device=flat.device)
    lengths.scatter_add_(0, seq, torch.ones_like(seq, dtype=torch.int32))
    layout = PackedSequences(batch, length, sequences, width, token_slots, slot_tokens, lengths)
    return positions, layout
