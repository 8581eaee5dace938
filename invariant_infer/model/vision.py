"""Qwen2.5-VL's vision tower on the invariant kernels: each image's features are bitwise those of
the image alone, whatever images share the call and in whatever order.

Every op but attention works on one token (one row) at a time with a fixed reduction order: the
patch embedding (the Conv3d, whose stride equals its kernel, is one GEMM over flattened patches),
the RMSNorms, the qkv/proj/MLP projections, the merger's GELU. Attention runs over segments (a
window of patches, or one image's frame) laid out one segment per row of a padded batch, every
query seeing every key of its own segment: the kernel's KV blocks start at each segment's first
patch, so no other segment can move a block or add a term. The 2-D rotary embedding is a lookup
in a cos/sin table of fixed size computed once (as the language model's rope), so a patch's
values never depend on the grid sizes beside it.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..errors import NonInvariantInputError
from ..kernels import attention, gelu, linear, silu_mul
from .module_state import module_state, state_of

# The vision rope table's length: patch rows and columns per image (a 3584-pixel side at 14-pixel patches is 256).
VISION_ROPE_POSITIONS = 1024


def set_vision_rope_tables(tower: nn.Module) -> None:
    """(cos, sin) fp32 [VISION_ROPE_POSITIONS, head_dim / 4] of the tower's axial rotary frequencies."""
    inv_freq = tower.rotary_pos_emb.inv_freq.float()
    freqs = torch.arange(VISION_ROPE_POSITIONS, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq
    module_state(tower).rope_tables = (freqs.cos(), freqs.sin())


def _grids(grid_thw: torch.Tensor, merge: int) -> list[tuple[int, int, int]]:
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    for t, h, w in grids:
        if h % merge or w % merge or max(h, w) > VISION_ROPE_POSITIONS or t < 1:
            raise NonInvariantInputError(f"image grid (t, h, w) = {(t, h, w)}: h and w must be multiples of the "
                                         f"spatial merge size {merge} and at most {VISION_ROPE_POSITIONS}")
    return grids


def patch_positions(t: int, h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch of one image, in the tower's order: merge x merge blocks, block-major."""
    rows = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2)
    cols = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2)
    return rows.flatten().repeat(t), cols.flatten().repeat(t)


def window_order(t: int, h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """One image's merged units (merge x merge patches) in window order, and each window's length in
    units: windows of ``window`` x ``window`` units from the top-left corner, row-major, per frame
    (the last row and column of windows cut short by the image's edge), as Qwen2.5-VL orders them."""
    units_h, units_w = h // merge, w // merge
    index = torch.arange(t * units_h * units_w).reshape(t, units_h, units_w)
    order, lengths = [], []
    for frame in range(t):
        for top in range(0, units_h, window):
            for left in range(0, units_w, window):
                block = index[frame, top:top + window, left:left + window].flatten()
                order.append(block)
                lengths.append(block.numel())
    return torch.cat(order), lengths


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                      scale: float) -> torch.Tensor:
    """q, k, v [N, H, D] holding consecutive segments of ``lengths`` -> [N, H, D]: each query attends
    to every key of its own segment (no causal mask). The segments run as rows of one padded batch;
    a query position past every key (q_start = the row width) makes the causal kernel see them all."""
    width = max(lengths)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    sizes = torch.tensor(lengths)
    offsets = torch.arange(width)
    valid = offsets[None, :] < sizes[:, None]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0).to(q.device)
    rows = [x[index].permute(0, 2, 1, 3) for x in (q, k, v)]  # [S, H, width, D], strided
    kv_end = sizes.to(device=q.device, dtype=torch.int32)
    kv_start = torch.zeros_like(kv_end)
    q_start = torch.full_like(kv_end, width)
    out = attention(*rows, kv_start, kv_end, q_start, scale)  # [S, width, H, D]
    return out[valid.to(q.device)]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_vision for one of q, k: in fp32, rounded back."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return ((xf * cos) + (rotated * sin)).to(x.dtype)


def _block_forward(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   lengths: list[int]) -> torch.Tensor:
    attn = block.attn
    h = block.norm1(x)
    q, k, v = attn.qkv(h).reshape(x.shape[0], 3, attn.num_heads, -1).unbind(1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    out = segment_attention(q, k, v, lengths, attn.scaling)
    x = x + attn.proj(out.reshape(x.shape[0], -1))
    mlp = block.mlp
    h = block.norm2(x)
    return x + mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))


def qwen2_5_vision_forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
    """The patched forward of ``Qwen2_5_VisionTransformerPretrainedModel``: patches [N, C*T*P*P] of
    the images of ``grid_thw`` -> last_hidden_state [N, hidden] (window order, as stock) and
    pooler_output [N / merge^2, out_hidden] (image order)."""
    merge = self.spatial_merge_size
    unit = merge * merge
    grids = _grids(grid_thw, merge)
    if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
        raise NonInvariantInputError("training the vision tower is not supported yet: freeze it "
                                     "(model.model.visual.requires_grad_(False)) or run under torch.no_grad()")
    window = self.window_size // merge // self.patch_size
    device = hidden_states.device
    cos_table, sin_table = state_of(self).rope_tables
    orders, windows, frames, rows, cols = [], [], [], [], []
    first_unit = 0
    for t, h, w in grids:
        order, lengths = window_order(t, h, w, merge, window)
        orders.append(order + first_unit)
        windows += [n * unit for n in lengths]
        frames += [h * w] * t
        r, c = patch_positions(t, h, w, merge)
        rows.append(r)
        cols.append(c)
        first_unit += t * (h // merge) * (w // merge)
    unit_order = torch.cat(orders)
    patch_order = (unit_order[:, None] * unit + torch.arange(unit)).flatten()
    rows, cols = torch.cat(rows)[patch_order].to(cos_table.device), torch.cat(cols)[patch_order].to(cos_table.device)
    # Per patch, in window order: cos/sin [N, 1, head_dim] = (row, column, row, column) frequencies.
    cos = torch.cat([cos_table[rows], cos_table[cols]] * 2, dim=-1).to(device)[:, None, :]
    sin = torch.cat([sin_table[rows], sin_table[cols]] * 2, dim=-1).to(device)[:, None, :]
    patch_order = patch_order.to(device)

    embed = self.patch_embed.proj
    x = linear(hidden_states.to(embed.weight.dtype), embed.weight.reshape(embed.weight.shape[0], -1))
    x = x[patch_order]
    for index, block in enumerate(self.blocks):
        x = _block_forward(block, x, cos, sin, frames if index in self.fullatt_block_indexes else windows)
    merger = self.merger
    merged = merger.ln_q(x).reshape(-1, merger.hidden_size)
    merged = merger.mlp[2](gelu(merger.mlp[0](merged)))
    merged = merged[torch.argsort(unit_order).to(device)]
    return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=merged)
