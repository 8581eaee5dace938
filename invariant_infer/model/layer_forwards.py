"""The forwards ``make_invariant`` installs on a decoder's plain modules: each ``nn.Linear`` (and the
row-parallel o_proj/down_proj, whose K reduces as tensor parallelism splits it), a quantized projection
read as dequantized float weights, each family's RMSNorm, and each MLP (silu(gate) * up fused into the
down projection's prologue; Gemma's gelu_tanh; compressed projections unfused). Encoder families'
linears take ``linear_forward`` too.

With autograd recording (grad enabled and an input or parameter that requires grad), each op runs
as its autograd Function: the same forward kernel, so the same bits as inference, plus a
batch-invariant, deterministic backward. Otherwise the plain kernel runs (no saved tensors).

These forwards read the kernels through this module's globals (``linear``, ``linear_autograd``, ...),
so the tests' negative controls swap ``invariant_infer.model.layer_forwards.linear`` for a
batch-dependent one and check that invariance then fails.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import (gelu_tanh_mul, gelu_tanh_mul_autograd, linear, linear_autograd, rms_norm, rms_norm_autograd,
                       silu_mul, silu_mul_autograd, silu_mul_linear_autograd)
from ..kernels.configs import row_parallel_config
from ..kernels.fused_linear import silu_mul_linear
from .module_state import state_of
from .recomputed_backward import recomputed_backward


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _records_grad(x, self.weight, self.bias):
        return linear_autograd(x, self.weight, self.bias)
    return linear(x, self.weight, self.bias)


def dequantized_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # A quantized projection read as float weights (latent attention's kv_b_proj, which the absorbed
    # forward never calls): called directly, it runs on the same dequantized weight.
    return linear(x, state_of(self).dequantized_weight, self.bias)


def row_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    config = row_parallel_config(x.device.type, x.dtype, *self.weight.shape)
    if _records_grad(x, self.weight, self.bias):
        return linear_autograd(x, self.weight, self.bias, config=config)
    return linear(x, self.weight, self.bias, config=config)


def zero_centred_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = self.eps

    def reference(x, weight):  # Qwen3.5's own formula
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(hidden_states.dtype)
    return recomputed_backward(rms_norm(hidden_states, self.weight, eps, zero_centred=True), reference,
                               hidden_states, self.weight)


def fp32_scaled_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps  # Gemma 4 in transformers 5.17: eps
    if not getattr(self, "with_scale", True):  # Gemma 4's v_norm: no weight, so x * rsqrt(ms) * 1.0
        ones = torch.ones(hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
        return rms_norm(hidden_states, ones, eps, scale_in_fp32=True)

    def reference(x, weight):  # gpt-oss's own formula
        x = x.float()
        return (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).to(hidden_states.dtype)
    return recomputed_backward(rms_norm(hidden_states, self.weight, eps, scale_in_fp32=True), reference,
                               hidden_states, self.weight)


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if _records_grad(hidden_states, self.weight):
        return rms_norm_autograd(hidden_states, self.weight, self.variance_epsilon)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # silu(gate) * up is computed inside the down projection's prologue: bitwise what
    # down_proj(silu_mul(gate, up)) gives, without writing the [tokens x intermediate] product.
    down = self.down_proj
    gate, up = self.gate_proj(x), self.up_proj(x)
    down_state = state_of(down)
    if down_state is not None and down_state.adds_lora_delta:  # a LoRA delta needs the product itself
        return down(silu_mul_autograd(gate, up) if _records_grad(gate, up) else silu_mul(gate, up))
    config = row_parallel_config(gate.device.type, gate.dtype, *down.weight.shape)
    if _records_grad(gate, up, down.weight, down.bias):
        return silu_mul_linear_autograd(gate, up, down.weight, down.bias, config=config)
    return silu_mul_linear(gate, up, down.weight, down.bias, config=config)


def gelu_tanh_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # Gemma's gelu_tanh(gate) * up, written, then down (plain, quantized or with a LoRA delta).
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(gelu_tanh_mul_autograd(gate, up) if _records_grad(gate, up) else gelu_tanh_mul(gate, up))


def quantized_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # Compressed projections cannot take the fused prologue: silu(gate) * up is written, then down runs.
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(silu_mul_autograd(gate, up) if _records_grad(gate, up) else silu_mul(gate, up))
