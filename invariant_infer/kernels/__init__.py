"""Batch-invariant Triton kernels with thin launchers on torch tensors.

Shipped as ``invariant_infer.kernels``. CUDA tensors run compiled kernels; CPU tensors run
the same kernels through Triton's interpreter with the fixes in ``interpreter_harness``.
Nothing here knows about transformers.
"""
from .attention import attention
from .attention_autograd import AttentionFunction, attention_autograd
from .causal_conv1d import causal_conv1d_silu
from .clamped_swiglu import clamped_swiglu
from .configs import (AttentionBackwardConfig, AttentionConfig, LinearConfig, attention_backward_config,
                      attention_config, linear_config)
from .fused_linear_autograd import SiluMulLinearFunction, silu_mul_linear_autograd
from .gated_delta_rule import chunk_gated_delta_rule
from .gelu import GeluFunction, gelu, gelu_autograd
from .gelu_tanh_mul import GeluTanhMulFunction, gelu_tanh_mul, gelu_tanh_mul_autograd
from .grouped_linear import grouped_linear, grouped_silu_mul_linear
from .grouped_quantized_linear import grouped_quantized_linear
from .l2_normalize import l2_normalize
from .layer_norm import layer_norm
from .layer_norm_autograd import LayerNormFunction, layer_norm_autograd
from .linear import linear
from .linear_autograd import LinearFunction, linear_autograd
from .moe_group_routing import moe_group_routing
from .moe_routing import moe_routing
from .paged_attention import paged_attention, write_kv
from .pooling import pool_tokens
from .quantize_activations import quantize_activations
from .quantized_linear import QuantizedLinearConfig, QuantizedWeight, dequantize_weight, quantized_linear
from .quantized_linear_autograd import QuantizedLinearFunction, quantized_linear_autograd
from .rms_norm import rms_norm
from .rms_norm_gated import rms_norm_gated
from .rms_norm_autograd import RMSNormFunction, rms_norm_autograd
from .sigmoid_mul import sigmoid_mul
from .silu_mul import silu_mul
from .silu_mul_autograd import SiluMulFunction, silu_mul_autograd
from .token_logprobs import token_logprobs
from .token_logprobs_autograd import TokenLogprobsFunction, token_logprobs_autograd

__all__ = [
    "AttentionConfig", "attention", "attention_config",
    "AttentionBackwardConfig", "AttentionFunction", "attention_autograd", "attention_backward_config",
    "LinearConfig", "linear", "linear_config", "LinearFunction", "linear_autograd",
    "grouped_linear", "grouped_silu_mul_linear", "moe_routing", "moe_group_routing", "clamped_swiglu",
    "paged_attention", "write_kv",
    "QuantizedLinearConfig", "QuantizedWeight", "dequantize_weight", "grouped_quantized_linear", "quantize_activations",
    "quantized_linear",
    "QuantizedLinearFunction", "quantized_linear_autograd",
    "layer_norm", "LayerNormFunction", "layer_norm_autograd", "rms_norm", "rms_norm_gated", "pool_tokens", "l2_normalize",
    "silu_mul", "token_logprobs", "causal_conv1d_silu", "chunk_gated_delta_rule",
    "sigmoid_mul", "gelu", "GeluFunction", "gelu_autograd",
    "gelu_tanh_mul", "GeluTanhMulFunction", "gelu_tanh_mul_autograd",
    "RMSNormFunction", "rms_norm_autograd", "SiluMulFunction", "silu_mul_autograd",
    "SiluMulLinearFunction", "silu_mul_linear_autograd", "TokenLogprobsFunction", "token_logprobs_autograd",
]
