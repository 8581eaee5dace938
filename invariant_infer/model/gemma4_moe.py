"""Gemma 4's mixture of experts (``enable_moe_block``: 26B-A4B) on the invariant kernels, as
transformers computes it beside the dense MLP of each layer:

* the router reads the layer's residual (not a normed input): a weightless RMSNorm (the patched
  norm, fp32), times its learned ``scale`` times hidden^-0.5 (exact elementwise multiplies), the
  invariant linear, then ``route`` (fp32 softmax, top-k with ties to the lowest index, renormalised
  in rank order), then each chosen expert's ``per_expert_scale`` (an exact fp32 multiply per weight);
* the experts read ``pre_feedforward_layernorm_2(residual)``: [gate; up] concatenated in
  ``gate_up_proj`` [E, 2I, H], gelu_tanh(gate) * up, ``down_proj`` [E, H, I], through
  ``experts.routed_forward`` (grouped kernels, outputs combined per token in rank order, fp32).
"""
from __future__ import annotations

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

from ..errors import UnsupportedModelError
from .experts import gelu_tanh_expert_forward, refuse_grad, route, routed_forward


def route_tokens(router: Gemma4TextRouter, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [T, H] -> (weights fp32 [T, k], experts int64 [T, k]), each token on its own."""
    refuse_grad(x, router.proj.weight, router.scale, router.per_expert_scale)
    scaled = router.norm(x) * router.scale * router.scalar_root_size
    weights, experts = route(router.proj(scaled), router.config.top_k_experts, normalize=True)
    return weights * router.per_expert_scale[experts], experts


def check_layer(layer, name: str = "the layer") -> None:
    """Refuses a decoder layer ``name`` whose MoE block (if it has one) the invariant forward would not
    compute: a router or experts of another class (transformers' ``FP8Experts`` of an fp8 checkpoint,
    or replaced by hand), or experts whose weights are not 3-D parameters (quantized or packed)."""
    if not getattr(layer, "enable_moe_block", False):
        return
    router, experts = getattr(layer, "router", None), getattr(layer, "experts", None)
    if type(router) is not Gemma4TextRouter or type(experts) is not Gemma4TextExperts:
        raise UnsupportedModelError(f"{name}: Gemma 4's MoE block has {type(router).__name__} and "
                                    f"{type(experts).__name__}; the invariant forward computes Gemma4TextRouter and "
                                    "Gemma4TextExperts (quantized experts are not supported for Gemma 4)")
    for proj in ("gate_up_proj", "down_proj"):
        if type(getattr(experts, proj, None)) is not torch.nn.Parameter or getattr(experts, proj).dim() != 3:
            raise UnsupportedModelError(f"{name}: Gemma 4's experts.{proj} is not a 3-D parameter (quantized or "
                                        "packed experts are not supported for Gemma 4)")


def moe_forward(layer, residual: torch.Tensor) -> torch.Tensor:
    """The experts' output of a Gemma 4 decoder layer for its residual [..., H], before
    ``post_feedforward_layernorm_2``, in the residual's dtype."""
    check_layer(layer)
    experts = layer.experts
    flat = residual.reshape(-1, residual.shape[-1])
    weights, chosen = route_tokens(layer.router, flat)
    x = layer.pre_feedforward_layernorm_2(flat)
    refuse_grad(x, experts.gate_up_proj, experts.down_proj)
    routed = routed_forward(x, chosen, weights, experts.num_experts,
                            lambda tokens, offsets: gelu_tanh_expert_forward(x[tokens], experts.gate_up_proj,
                                                                             experts.down_proj, offsets))
    return routed.reshape(residual.shape)
