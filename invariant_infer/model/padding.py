"""How a batch of sequences is laid out: padding, mask checks, positions and attention bounds.

A row of a batch holds one contiguous run of real tokens, with padding on its left, its right,
or both. Every rule that keeps a row's result independent of that padding lives here:
  * positions count real tokens only (``cumsum(mask) - 1``, pads at 0), so a padded row gets
    the positions it has alone;
  * attention bounds are given per row (first real key, end of real keys, first query's
    position), so the attention kernel aligns its KV blocks to the row's first real token;
  * masks with holes, positions past the RoPE table, and prompts that are not left-padded
    for generation are refused with ``NonInvariantInputError``.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ..errors import InvalidArgumentError, NonInvariantInputError


def pad_sequences(sequences: Sequence[Sequence[int]], *, side: str = "left", pad_token_id: int = 0,
                  width: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both long [B, width], each sequence padded on ``side``.

    ``width`` defaults to the longest sequence; a larger one adds padding to every row."""
    if side not in ("left", "right"):
        raise InvalidArgumentError(f"side must be 'left' or 'right', got {side!r}")
    longest = max((len(seq) for seq in sequences), default=0)
    width = longest if width is None else width
    if width < longest:
        raise InvalidArgumentError(f"width {width} is shorter than the longest sequence ({longest})")
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if not len(seq):
            continue
        start = width - len(seq) if side == "left" else 0
        input_ids[row, start:start + len(seq)] = torch.as_tensor(
            seq.tolist() if hasattr(seq, "tolist") else list(seq), dtype=torch.long)
        attention_mask[row, start:start + len(seq)] = 1
    return input_ids.to(device), attention_mask.to(device)


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int = 0, device=None):
    """(input_ids, attention_mask) with each sequence right-aligned, as generation needs."""
    return pad_sequences(sequences, side="left", pad_token_id=pad_token_id, device=device)


def cache_length(forward_kwargs: dict) -> int:
    """Tokens already in the cache a forward's keywords carry (``cache``, or ``past_key_values`` before 5.24)."""
    cache = forward_kwargs.get("cache", forward_kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


def positions_from_mask(attention_mask: torch.Tensor, query_length: int) -> torch.Tensor:
    """position_ids for the last ``query_length`` columns: cumsum(mask) - 1, pads at 0."""
    mask = attention_mask.to(torch.long)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return positions[:, -query_length:]


def mask_holes(mask: torch.Tensor) -> torch.Tensor:
    """bool [B]: rows whose ones are not one contiguous run."""
    mask = mask.to(torch.int32)
    count = mask.sum(-1)
    first = mask.argmax(-1)
    last = mask.shape[-1] - 1 - mask.flip(-1).argmax(-1)
    return (count > 0) & (last - first + 1 != count)


def _holes_error(holes: torch.Tensor) -> NonInvariantInputError:
    rows = holes.nonzero().flatten().tolist()
    return NonInvariantInputError(
        f"attention_mask rows {rows[:8]} have holes (their ones are not contiguous). Invariant inference "
        "supports left or right padding around one contiguous run of real tokens per row. In generation, "
        "pad prompts on the left (tokenizer.padding_side = 'left').")


def resolve_positions(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, *,
                      query_length: int, cache_length: int, max_positions: int,
                      check: bool = True) -> torch.Tensor | None:
    """The position_ids a forward pass runs with, after checking the layout.

    Without ``position_ids`` and with a 2-D mask, they are derived from the mask. A mask that
    ``sequence_bounds`` prepared (generate does so for static caches, after checking the 2-D
    mask) is not checked again. With
    ``check`` (the default; off while tracing, where it would sync with the host), raises on a
    mask with holes or real-token positions outside [0, max_positions), and warns when given
    positions disagree with the mask. Returns None when the model's own default
    (``arange(cache_length, cache_length + query_length)``) applies."""
    has_mask = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
    derived = positions_from_mask(attention_mask, query_length) if has_mask else None
    positions = position_ids if position_ids is not None else derived
    if not check:
        return positions
    if positions is None:
        total = cache_length + query_length
        if total > max_positions:
            raise NonInvariantInputError(f"sequence of {total} positions is longer than max_position_embeddings "
                                         f"({max_positions})")
        return None
    false = torch.zeros((), dtype=torch.bool, device=positions.device)
    if has_mask:
        real = attention_mask[:, -query_length:].to(torch.bool)
        expanded = positions.expand(real.shape[0], -1)
        restarts = real[:, 1:] & real[:, :-1] & (expanded[:, 1:] == 0)  # packed rows, which take no mask
        flags = torch.stack([mask_holes(attention_mask).any(),
                             (real & ((expanded < 0) | (expanded >= max_positions))).any(),
                             (real & (expanded != derived)).any(), restarts.any()])  # no value-sized indexing
    else:
        flags = torch.stack([false, (positions < 0).any() | (positions >= max_positions).any(), false, false])
    holes, out_of_range, disagree, packed = flags.tolist()  # one host sync for all checks
    if holes:
        raise _holes_error(mask_holes(attention_mask))
    if packed:
        raise NonInvariantInputError(
            "position_ids restart at 0 inside a row's real tokens, as in packed rows, but an attention_mask was "
            "given: packed rows take no attention_mask (as DataCollatorWithFlattening builds them); padded rows "
            "hold one sequence each")
    if out_of_range:
        raise NonInvariantInputError(f"position ids of real tokens must lie in [0, {max_positions}) "
                                     "(max_position_embeddings)")
    if disagree and position_ids is not None:
        # Honoured, as in stock transformers; but such rows cannot match the same samples run alone.
        warnings.warn("position_ids do not equal cumsum(attention_mask) - 1 on real tokens; padded rows will not "
                      "match the same samples run alone. Omit position_ids to have them derived from the mask.",
                      stacklevel=4)
    return positions


def check_multimodal_positions(attention_mask, position_ids: torch.Tensor, max_positions: int) -> None:
    """Checks multimodal rope positions [3 or 4, B, L] (Qwen2.5-VL's, from ``get_rope_index``, which counts
    each row's real tokens only): a 2-D mask without holes, real tokens' positions in [0, max_positions)."""
    has_mask = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
    if has_mask:
        if bool(mask_holes(attention_mask).any()):
            raise _holes_error(mask_holes(attention_mask))
        real = attention_mask[:, -position_ids.shape[-1]:].to(torch.bool).expand_as(position_ids)
        positions = position_ids[real]
    else:
        positions = position_ids
    if bool(((positions < 0) | (positions >= max_positions)).any()):
        raise NonInvariantInputError(f"position ids of real tokens must lie in [0, {max_positions}) "
                                     "(max_position_embeddings)")


def check_left_padded(attention_mask: torch.Tensor) -> bool:
    """Raise unless every row is pads then one run of real tokens ending at the last column.
    Returns whether any row has padding."""
    if attention_mask.dim() != 2:
        raise NonInvariantInputError("generate needs a 2-D attention_mask [batch, length]")
    mask = attention_mask.to(torch.int64)
    count = mask.sum(-1)
    bad = (count == 0) | (mask[:, -1] == 0) | (mask.shape[-1] - mask.argmax(-1) != count)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise NonInvariantInputError(
            f"attention_mask rows {rows[:8]} are right-padded, empty or have holes. Generation appends tokens at "
            "the end of every row, so prompts must be left-padded: tokenizer.padding_side = 'left' (or use "
            "invariant_infer.model.padding.left_pad).")
    return bool((count < mask.shape[-1]).any())


def sequence_bounds(attention_mask: torch.Tensor | None, batch_size: int, kv_length: int,
                    q_offset, device, kv_offset=0) -> torch.Tensor:
    """int32 [3, B, 1, 1] with rows kv_start, kv_end, q_start, from a 2-D padding mask whose ones are
    contiguous. ``kv_offset``: the position of the first key the cache still holds (a sliding-window
    cache evicts older ones); the bounds are indices into the keys held, so kv_start is negative
    once a row's first real token was evicted.

    4-D, so that transformers treats it as a prepared mask and passes it through untouched (generate
    prepares masks up front for static caches). Traceable (no host sync): contiguity is checked by
    ``resolve_positions`` before the forward."""
    if attention_mask is None:
        kv_start = torch.full((batch_size,), -kv_offset, dtype=torch.int32, device=device)
        kv_end = torch.full((batch_size,), kv_length, dtype=torch.int32, device=device)
    else:
        mask = attention_mask[:, -(kv_offset + kv_length):].to(device=device, dtype=torch.int32)
        kv_start = (mask.argmax(dim=1) - kv_offset).to(torch.int32)  # first real key (an empty row: its first)
        kv_end = kv_start + mask.sum(dim=1, dtype=torch.int32)
    if isinstance(q_offset, torch.Tensor):
        q_start = (q_offset.to(device=device, dtype=torch.int32).reshape(-1)[:1] - kv_offset).expand(batch_size)
    else:
        q_start = torch.full((batch_size,), int(q_offset) - kv_offset, dtype=torch.int32, device=device)
    return torch.stack([kv_start, kv_end, q_start])[:, :, None, None]


def is_sequence_bounds(mask) -> bool:
    """Whether ``mask`` was made by ``sequence_bounds`` (a user's 4-D mask is [B, 1, Lq, Lk], bool or float)."""
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4 \
        and mask.shape[0] == 3 and mask.shape[2:] == (1, 1)
