"""The Qwen-VL vision towers (Qwen2.5-VL's and Qwen3-VL's) on the invariant kernels: each image's
features are bitwise those of the image alone, whatever images share the call and in whatever order.

Every op but attention works on one token (one row) at a time with a fixed reduction order: the
patch embedding (the Conv3d, whose stride equals its kernel, is one GEMM over flattened patches),
the norms (RMSNorm in 2.5, LayerNorm in 3), the qkv/proj/MLP projections, the GELUs, Qwen3-VL's
bilinear position embedding (four taps summed in one order) and its deepstack mergers. Attention runs over segments (a
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
from ..kernels import attention, gelu, layer_norm, linear, silu_mul
from .module_state import module_state, state_of
from .support import require

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


def _attention(attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               lengths: list[int]) -> torch.Tensor:
    q, k, v = attn.qkv(h).reshape(h.shape[0], 3, attn.num_heads, -1).unbind(1)
    out = segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, lengths, attn.scaling)
    return attn.proj(out.reshape(h.shape[0], -1))


def _qwen2_5_block(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   lengths: list[int]) -> torch.Tensor:
    x = x + _attention(block.attn, block.norm1(x), cos, sin, lengths)
    mlp, h = block.mlp, block.norm2(x)
    return x + mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))


def _layer_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer_norm(x, norm.weight, norm.bias, norm.eps)


def _qwen3_block(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 lengths: list[int]) -> torch.Tensor:
    x = x + _attention(block.attn, _layer_norm(block.norm1, x), cos, sin, lengths)
    mlp = block.mlp
    return x + mlp.linear_fc2(gelu(mlp.linear_fc1(_layer_norm(block.norm2, x)), approximate="tanh"))


def _qwen3_merger(merger: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's merger: LayerNorm before the merge x merge patches are joined (after, for the deepstack
    mergers), then linear, exact GELU, linear."""
    if merger.use_postshuffle_norm:
        x = _layer_norm(merger.norm, x.reshape(-1, merger.hidden_size))
    else:
        x = _layer_norm(merger.norm, x).reshape(-1, merger.hidden_size)
    return merger.linear_fc2(gelu(merger.linear_fc1(x)))


def _refuse_training(tower: nn.Module) -> None:
    if torch.is_grad_enabled() and any(p.requires_grad for p in tower.parameters()):
        require("trainable_vision_tower", "training")


def _rope(tower: nn.Module, rows: torch.Tensor, cols: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch: cos/sin [N, 1, head_dim] = (row, column, row, column) frequencies, from the tables."""
    cos_table, sin_table = state_of(tower).rope_tables
    rows, cols = rows.to(cos_table.device), cols.to(cos_table.device)
    cos = torch.cat([cos_table[rows], cos_table[cols]] * 2, dim=-1).to(device)[:, None, :]
    sin = torch.cat([sin_table[rows], sin_table[cols]] * 2, dim=-1).to(device)[:, None, :]
    return cos, sin


def _patch_embed(tower: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The Conv3d (stride = kernel) as one GEMM over the flattened patches [N, C*T*P*P]."""
    embed = tower.patch_embed.proj
    weight = embed.weight.reshape(embed.weight.shape[0], -1)
    return linear(hidden_states.to(weight.dtype), weight, embed.bias)


def qwen2_5_vision_forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
    """The patched forward of ``Qwen2_5_VisionTransformerPretrainedModel``: patches [N, C*T*P*P] of
    the images of ``grid_thw`` -> last_hidden_state [N, hidden] (window order, as stock) and
    pooler_output [N / merge^2, out_hidden] (image order)."""
    merge = self.spatial_merge_size
    unit = merge * merge
    grids = _grids(grid_thw, merge)
    _refuse_training(self)
    window = self.window_size // merge // self.patch_size
    device = hidden_states.device
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
    cos, sin = _rope(self, torch.cat(rows)[patch_order], torch.cat(cols)[patch_order], device)
    x = _patch_embed(self, hidden_states)[patch_order.to(device)]
    for index, block in enumerate(self.blocks):
        x = _qwen2_5_block(block, x, cos, sin, frames if index in self.fullatt_block_indexes else windows)
    merger = self.merger
    merged = merger.ln_q(x).reshape(-1, merger.hidden_size)
    merged = merger.mlp[2](gelu(merger.mlp[0](merged)))
    merged = merged[torch.argsort(unit_order).to(device)]
    return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=merged)


def _bilinear_positions(tower: nn.Module, rows: torch.Tensor, cols: torch.Tensor, heights: torch.Tensor,
                        widths: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's learned position embedding (a side x side grid) sampled at each patch of its image's
    h x w grid, bilinear with aligned corners: 2 x 2 taps, their weighted sum in fp32 in one order."""
    side = tower.num_grid_per_side
    table = tower.pos_embed.weight

    def axis(index, size):
        src = index.float() * (side - 1) / (size - 1).clamp(min=1).float()
        floor = torch.floor(src)
        offsets = torch.arange(2)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    row_taps, row_weights = axis(rows, heights)
    col_taps, col_weights = axis(cols, widths)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4).to(table.device)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4).to(table.device)
    terms = table[indices] * weights[:, :, None]
    return ((terms[:, 0] + terms[:, 1]) + terms[:, 2]) + terms[:, 3]


def qwen3_vl_vision_forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
    """The patched forward of ``Qwen3VLVisionModel``: patches [N, C*T*P*P] -> last_hidden_state [N, hidden],
    pooler_output [N / merge^2, out_hidden] and the deepstack mergers' features, each [N / merge^2,
    out_hidden] (image order throughout)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures
    merge = self.spatial_merge_size
    grids = _grids(grid_thw, merge)
    _refuse_training(self)
    device = hidden_states.device
    positions = [patch_positions(t, h, w, merge) for t, h, w in grids]
    rows, cols = torch.cat([r for r, _ in positions]), torch.cat([c for _, c in positions])
    sizes = [t * h * w for t, h, w in grids]
    heights = torch.cat([torch.full((n,), h) for n, (_, h, _) in zip(sizes, grids)])
    widths = torch.cat([torch.full((n,), w) for n, (_, _, w) in zip(sizes, grids)])
    cos, sin = _rope(self, rows, cols, device)
    x = _patch_embed(self, hidden_states)
    x = x + _bilinear_positions(self, rows, cols, heights, widths).to(device=device, dtype=x.dtype)
    frames = [h * w for t, h, w in grids for _ in range(t)]
    deepstack = []
    for index, block in enumerate(self.blocks):
        x = _qwen3_block(block, x, cos, sin, frames)
        if index in self.deepstack_visual_indexes:
            deepstack.append(_qwen3_merger(self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)], x))
    return BaseModelOutputWithDeepstackFeatures(last_hidden_state=x, pooler_output=_qwen3_merger(self.merger, x),
                                                deepstack_features=deepstack)
