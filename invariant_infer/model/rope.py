"""The rotary embedding as a table lookup: cos/sin for every position, computed once per model
with transformers' own formula, so that a position's values never depend on where it sits in a
batch (elementwise kernels on CPU differ between vectorized bodies and scalar tails)."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .module_state import module_state, state_of


def rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
    """The patched forward of a model's rotary embedding: (cos, sin) of ``position_ids`` in x's dtype."""
    state = state_of(self)
    tables = state.rope_tables if layer_type is None else state.rope_tables_by_type[layer_type]
    cos_table, sin_table = tables
    if cos_table.device != x.device:
        cos_table, sin_table = cos_table.to(x.device), sin_table.to(x.device)
        if layer_type is None:
            state.rope_tables = (cos_table, sin_table)
        else:
            state.rope_tables_by_type[layer_type] = (cos_table, sin_table)
    if position_ids.dim() == 3 and state.mrope_axes is not None:
        if state.mrope_axes.device != x.device:
            state.mrope_axes = state.mrope_axes.to(x.device)
        return _mrope(cos_table, x.dtype, position_ids, state.mrope_axes), \
            _mrope(sin_table, x.dtype, position_ids, state.mrope_axes)
    if position_ids.dim() == 3:  # multimodal RoPE sections (Qwen3.5): text positions repeat one section
        position_ids = position_ids[0]  # (sections that differ are refused before the forward: input_checks.py)
    idx = position_ids.clamp(0, cos_table.shape[0] - 1)  # range is checked before the forward
    return cos_table[idx].to(x.dtype), sin_table[idx].to(x.dtype)


def mrope_axes(sections, interleaved: bool) -> tuple[int, ...]:
    """Which of the (temporal, height, width) positions each rotary frequency takes, as transformers
    composes them: in sections (Qwen2.5-VL: the first ``sections[0]`` frequencies temporal, then height,
    then width) or interleaved (Qwen3-VL: t h w t h w ..., height and width over their first
    3 * sections[i] frequencies, temporal elsewhere)."""
    half = sum(sections)
    if not interleaved:
        return tuple(axis for axis, width in enumerate(sections) for _ in range(width))
    return tuple(j % 3 if (j % 3 and j < 3 * sections[j % 3]) else 0 for j in range(half))


def _mrope(table: torch.Tensor, dtype: torch.dtype, position_ids: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Multimodal rope from a table: [3, B, L] (temporal, height, width) positions -> [B, L, D]; frequency
    j takes its value at positions[axes[j]] (``axes``: long [D / 2], on the table's device)."""
    idx = position_ids.clamp(0, table.shape[0] - 1)
    rows = idx[axes].permute(1, 2, 0)  # [B, L, D / 2]: each frequency's position
    values = table.gather(0, rows.flatten(0, 1)).view(rows.shape)
    return torch.cat((values, values), dim=-1).to(dtype)


def set_rope_tables(rotary: nn.Module, max_positions: int, half: bool = False,
                    mrope_axes: tuple[int, ...] | None = None) -> None:
    """Compute the tables of ``rotary`` (one set per layer type where it keeps several, as Gemma 3's)
    into its module state. ``half``: cos/sin of the frequencies themselves, for a family whose apply
    pairs them with the two halves of each head (gpt-oss); otherwise repeated over both halves.
    ``mrope_axes``: a multimodal rope's axis per frequency (see ``mrope_axes``), kept as a long tensor on
    the tables' device and read with 3-D positions."""
    state = module_state(rotary)
    state.mrope_axes = None
    if getattr(rotary, "layer_types", None):
        state.rope_tables_by_type = {t: rope_tables(rotary, max_positions, t, half) for t in rotary.layer_types}
        state.rope_tables = next(iter(state.rope_tables_by_type.values()))
    else:
        state.rope_tables = rope_tables(rotary, max_positions, half=half)
    if mrope_axes is not None:
        frequencies = state.rope_tables[0].shape[-1] // 2
        if len(mrope_axes) != frequencies:
            raise UnsupportedModelError(f"mrope_section covers {len(mrope_axes)} rotary frequencies, not the "
                                        f"model's {frequencies}")
        state.mrope_axes = torch.tensor(mrope_axes, dtype=torch.long, device=state.rope_tables[0].device)


def rope_tables(rotary: nn.Module, max_positions: int, layer_type: str | None = None, half: bool = False):
    """(cos, sin) fp32 [max_positions, D or D / 2], scaled by the embedding's attention scaling (yarn's)."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(rotary, f"{prefix}inv_freq").float()
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = freqs if half else torch.cat((freqs, freqs), dim=-1)
    scaling = getattr(rotary, f"{prefix}attention_scaling", 1.0)
    return emb.cos() * scaling, emb.sin() * scaling
