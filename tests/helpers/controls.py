"""Negative controls: batch-variant stand-ins for the invariant kernels that an invariance test must
catch (a BLOCK_K picked by M, a per-tensor activation scale)."""
from __future__ import annotations

import torch

from invariant_infer.kernels import LinearConfig, grouped_linear, linear, linear_config, quantized_linear
from invariant_infer.model.module_state import state_of


def m_dependent_linear(x, weight, bias=None, config=None, small_m: int = 4):
    """Negative control: picks BLOCK_K by M (up to ``small_m`` rows or more), as batch-size-keyed
    heuristics and autotuners do (whatever ``config`` the caller asks for, e.g. a row-parallel layer's K tree)."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    base = linear_config(x.device.type, x.dtype, *weight.shape)
    cfg = LinearConfig(base.block_m, base.block_n, 16 if m <= small_m else 64)
    return linear(x, weight, bias, config=cfg)


def m_dependent_grouped_linear(x, weight, expert_offsets, bias=None, offsets_valid=False):
    """Negative control for the grouped expert GEMM: picks BLOCK_K by the largest expert's row
    count, as batch-size-keyed grouped GEMMs do."""
    base = linear_config(x.device.type, x.dtype, *weight.shape[1:])
    most = int((expert_offsets[1:] - expert_offsets[:-1]).max())
    cfg = LinearConfig(base.block_m, base.block_n, 16 if most <= 4 else 64)
    return grouped_linear(x, weight, expert_offsets, bias, config=cfg, offsets_valid=offsets_valid)


def per_tensor_scaled_quantized_forward(self, x):
    """Negative control for a patched fp8 layer: a dynamic per-tensor activation scale, the max over
    every token of the call (the batch), on the layer's own quantized GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    scale = (x2.float().abs().amax() / 448).clamp(min=1e-12)
    q = (x2.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = scale.reshape(1, 1).expand(x2.shape[0], x2.shape[1] // 128).contiguous()
    y = quantized_linear(q, state_of(self).quantized.weight, self.bias, x_scale=scales, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])
