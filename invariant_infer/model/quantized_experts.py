"""Quantized mixture-of-experts experts kept compressed: transformers' ``FP8Experts`` on the grouped quantized GEMM.

transformers' own ``fp8`` format (``weight_block_size`` [128, 128], as the official Qwen3 MoE FP8
checkpoints store their experts) loads each sparse block's experts as one ``FP8Experts``: fp8
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] with fp32 inverse scales per 128x128 block.
They run here as the dense experts do (``model.experts``: the pairs sorted by expert, one grouped
launch per projection, the outputs combined in rank order), with the fp8 GEMM of
``kernels.grouped_quantized_linear``. Activations are quantized per token and 128-wide group, as
transformers' fp8 kernels quantize them: a row's scale comes from that row alone.

compressed-tensors checkpoints of MoE models are refused: transformers decompresses their experts
to the float dtype at load (only their attention layers stay compressed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..kernels import QuantizedWeight, grouped_quantized_linear, quantize_activations, silu_mul
from .experts import refuse_grad, routed_forward
from .module_state import state_of

BLOCK = 128
# FP8Experts attributes that change the math from silu(gate) * up, and the values computed here.
_STOCK_MATH = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True,
                   has_post_expert_norm=False, swiglu_alpha=None, swiglu_limit=None, limit=None,
                   gate_softcap=None, up_softcap=None)


@dataclass(frozen=True)
class QuantizedExpertsPlan:
    """How one quantized experts module runs: its stacked weights and activation groups."""
    gate_up: QuantizedWeight  # [E, 2I, H] values, [E, 2I / 128, H / 128] scales
    down: QuantizedWeight     # [E, H, I] values, [E, H / 128, I / 128] scales
    activation_group: int = BLOCK


def is_fp8_experts(module: nn.Module) -> bool:
    return (type(module).__name__ == "FP8Experts"
            and type(module).__module__.startswith("transformers.integrations.finegrained_fp8"))


def _refuse(name: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{name}: {what}; quantized experts are supported in transformers' fp8 format with "
                                 "[128, 128] weight blocks and dynamic activations (FP8Experts)")


def _stacked(name: str, module: nn.Module, proj: str, shape: tuple[int, int]) -> QuantizedWeight:
    weight, scale = getattr(module, proj), getattr(module, f"{proj}_scale_inv")
    if weight.dtype != torch.float8_e4m3fn:
        raise _refuse(name, f"{proj} is {weight.dtype} (fp4/NVFP4 experts)")
    n, k = shape
    expected = (module.num_experts, n // BLOCK, k // BLOCK)
    if tuple(weight.shape) != (module.num_experts, n, k) or tuple(scale.shape) != expected:
        raise _refuse(name, f"{proj} is {tuple(weight.shape)} with scales {tuple(scale.shape)}, expected "
                            f"{(module.num_experts, n, k)} with {expected}")
    if scale.dtype not in (torch.float32, torch.bfloat16):
        raise _refuse(name, f"{proj}_scale_inv is {scale.dtype} (UE8M0/MXFP8 scales)")
    return QuantizedWeight("fp8", weight.data, scale.data, shape, block=True)


def experts_plan(name: str, module: nn.Module, dtype: torch.dtype) -> QuantizedExpertsPlan:
    """The plan of one ``FP8Experts``, or the reason it cannot run batch-invariantly here."""
    if module.activation_scheme != "dynamic":
        raise _refuse(name, f"{module.activation_scheme} activation scales")
    if module.block_size is None or list(module.block_size) != [BLOCK, BLOCK]:
        raise _refuse(name, f"weight blocks {module.block_size}")
    for attr, value in _STOCK_MATH.items():
        if getattr(module, attr, value) != value:
            raise _refuse(name, f"{attr}={getattr(module, attr)!r}")
    hidden, intermediate = module.hidden_dim, module.intermediate_dim
    if hidden % BLOCK or intermediate % BLOCK:
        raise _refuse(name, f"hidden size {hidden} and expert intermediate size {intermediate} (both must be "
                            f"multiples of {BLOCK}, so that no 128x128 block straddles gate and up)")
    if dtype not in (torch.bfloat16, torch.float16):
        raise _refuse(name, f"{dtype} activations (fp8 experts run in bf16 or fp16: load with dtype=torch.bfloat16)")
    return QuantizedExpertsPlan(_stacked(name, module, "gate_up_proj", (2 * intermediate, hidden)),
                                _stacked(name, module, "down_proj", (hidden, intermediate)))


def quantized_experts(model: nn.Module) -> dict[nn.Module, QuantizedExpertsPlan]:
    """Every ``FP8Experts`` module of ``model`` with its plan (empty for other models)."""
    dtype = model.get_input_embeddings().weight.dtype
    return {module: experts_plan(name, module, dtype) for name, module in model.named_modules()
            if is_fp8_experts(module)}


def quantized_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """[T, H], [T, k] experts, [T, k] weights -> [T, H]: each pair's row quantized per token and
    group, ``grouped_quantized_linear`` for gate_up, silu(gate) * up, quantized again, then down."""
    refuse_grad(hidden_states, top_k_weights)
    plan: QuantizedExpertsPlan = state_of(self).quantized
    intermediate = plan.down.shape[1]
    q, scale = quantize_activations(hidden_states, torch.float8_e4m3fn, plan.activation_group)  # row-wise

    def run_sorted(tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gate_up = grouped_quantized_linear(q[tokens], plan.gate_up, offsets, x_scale=scale[tokens],
                                           out_dtype=hidden_states.dtype)
        h = silu_mul(gate_up[:, :intermediate], gate_up[:, intermediate:])
        hq, h_scale = quantize_activations(h, torch.float8_e4m3fn, plan.activation_group)
        return grouped_quantized_linear(hq, plan.down, offsets, x_scale=h_scale, out_dtype=hidden_states.dtype)

    return routed_forward(hidden_states, top_k_index, top_k_weights, self.num_experts, run_sorted)
