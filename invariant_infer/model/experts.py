"""Mixture-of-experts layers on the invariant kernels: the router's forward, and the experts
function registered with transformers' ``ExpertsInterface`` under the name ``invariant``.

Three places where stock MoE depends on the batch, and what runs here instead:
  * routing: the router linear on the invariant kernel, then ``route`` (the ``moe_routing``
    kernel): per token, softmax in fp32, the top-k (exact ties go to the lowest expert index),
    renormalised in rank order; or, for ``MoeLayout.routing`` "grouped_sigmoid", fp32 logits and
    the ``moe_group_routing`` kernel (sigmoid, group limit, selection bias, all per token);
  * experts: the (token, slot) pairs sorted by expert (stable), then ``expert_forward`` (the
    grouped kernels, one launch for all experts), whose every row is bitwise what that row
    alone gives through the linear kernel, however many rows its expert got;
  * combine: each token's k expert outputs weighted and summed in top-k rank order in fp32,
    then cast once (``combine``); no index_add_ / scatter-add, whose order depends on the batch.

A family's ``MoeLayout`` and ``FamilyAdapter`` are read here by attribute, not imported: Gemma 4's
layer forward, which its family module imports, runs its experts through this module.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from ..errors import UnsupportedModelError
from .support import require
from ..kernels import (clamped_swiglu, gelu_tanh_mul, grouped_linear, grouped_silu_mul_linear, linear,
                       moe_group_routing, moe_routing)

EXPERTS_IMPLEMENTATION = "invariant"
# The expert layouts the experts function computes, by MoeLayout.activation. "silu": concatenated
# [gate; up], [out, in] weights, no bias. "clamped_swiglu" (gpt-oss): interleaved gate/up columns,
# [in, out] weights, biases. Neither has a norm after the experts.
_EXPERT_LAYOUTS = {
    "silu": dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True, has_post_expert_norm=False),
    "clamped_swiglu": dict(has_gate=True, has_bias=True, is_transposed=True, is_concatenated=False,
                           has_post_expert_norm=False),
}


def refuse_grad(*tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        require("moe", "training")


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights fp32 [T, k], experts int64 [T, k]), descending, each row on its own."""
    return moe_routing(router_logits, top_k, normalize)


def expert_forward(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [S, H] sorted by expert (rows offsets[e]:offsets[e+1] are expert e's) -> [S, H]:
    down_proj[e] @ (silu(gate) * up), with [gate; up] = gate_up_proj[e] @ row. One grouped launch
    per projection; no host sync (``routed_forward``'s offsets are valid by construction: not read)."""
    intermediate = down_proj.shape[2]
    gate_up = grouped_linear(x, gate_up_proj, offsets, offsets_valid=True)
    return grouped_silu_mul_linear(gate_up[:, :intermediate], gate_up[:, intermediate:], down_proj, offsets,
                                   offsets_valid=True)


def gelu_tanh_expert_forward(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                             offsets: torch.Tensor) -> torch.Tensor:
    """Gemma 4's experts on rows sorted by expert: [gate; up] = gate_up_proj[e] @ row, then
    gelu_tanh(gate) * up (the elementwise kernel: each element alone), then down_proj[e] @ it."""
    intermediate = down_proj.shape[2]
    gate_up = grouped_linear(x, gate_up_proj, offsets, offsets_valid=True)
    hidden = gelu_tanh_mul(gate_up[:, :intermediate].contiguous(), gate_up[:, intermediate:].contiguous())
    return grouped_linear(hidden, down_proj, offsets, offsets_valid=True)


def clamped_swiglu_expert_forward(x: torch.Tensor, experts: nn.Module, offsets: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts on rows sorted by expert: gate_up = x @ gate_up_proj[e] + bias (columns
    gate, up, gate, up, ...), then ``clamped_swiglu``, then @ down_proj[e] + bias. The [in, out]
    weights are read through transposed views (no copy)."""
    gate_up = grouped_linear(x, experts.gate_up_proj.transpose(1, 2), offsets, bias=experts.gate_up_proj_bias,
                             offsets_valid=True)
    hidden = clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], experts.alpha, experts.limit)
    return grouped_linear(hidden, experts.down_proj.transpose(1, 2), offsets, bias=experts.down_proj_bias,
                          offsets_valid=True)


def combine(pair_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, k, H] expert outputs and [T, k] weights -> fp32 [T, H]: sum over ranks 0, 1, ..., k-1, in fp32."""
    weights = weights.float()
    total = pair_outputs[:, 0].float() * weights[:, 0, None]
    for rank in range(1, pair_outputs.shape[1]):
        total = total + pair_outputs[:, rank].float() * weights[:, rank, None]
    return total


def routed_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   num_experts: int, run_sorted) -> torch.Tensor:
    """Sort the (token, slot) pairs by expert (stable), run ``run_sorted(token_of_pair, offsets)``
    on them ([S] token indices in sorted order -> [S, H]), put the rows back and ``combine``."""
    tokens, top_k = top_k_index.shape
    by_expert, order = torch.sort(top_k_index.reshape(-1), stable=True)
    # offsets[e] = pairs routed to experts below e; searchsorted needs no host sync (bincount does)
    offsets = torch.searchsorted(by_expert, torch.arange(num_experts + 1, device=by_expert.device))
    sorted_out = run_sorted(order // top_k, offsets)
    pair_outputs = torch.empty_like(sorted_out)
    pair_outputs[order] = sorted_out  # a permutation: every row written once
    return combine(pair_outputs.view(tokens, top_k, -1), top_k_weights).to(hidden_states.dtype)


def invariant_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``invariant`` experts implementation: [T, H], [T, k] experts, [T, k] weights -> [T, H]."""
    refuse_grad(hidden_states, top_k_weights, self.gate_up_proj, self.down_proj)
    if not getattr(self, "is_concatenated", True):  # gpt-oss's layout (checked by check_sparse_block)
        refuse_grad(self.gate_up_proj_bias, self.down_proj_bias)
        return routed_forward(hidden_states, top_k_index, top_k_weights, self.num_experts,
                              lambda tokens, offsets: clamped_swiglu_expert_forward(hidden_states[tokens], self,
                                                                                    offsets))
    return routed_forward(hidden_states, top_k_index, top_k_weights, self.num_experts,
                          lambda tokens, offsets: expert_forward(hidden_states[tokens], self.gate_up_proj,
                                                                 self.down_proj, offsets))


def _softmax_routing(layout, router: nn.Module, x: torch.Tensor):
    bias = getattr(router, "bias", None)  # gpt-oss's router has one
    refuse_grad(x, router.weight, bias)
    logits = linear(x, router.weight, bias)
    weights, experts = route(logits, router.top_k, layout.normalize(router))
    return logits, weights.to(logits.dtype) if layout.weights_in_logits_dtype else weights, experts


def _grouped_sigmoid_routing(layout, router: nn.Module, x: torch.Tensor):
    """Glm4MoeTopkRouter / DeepseekV3TopkRouter: fp32 logits (inputs and weight upcast, as stock), then
    ``moe_group_routing``; the weights stay fp32, as stock's."""
    refuse_grad(x, router.weight)
    logits = linear(x.float(), router.weight.float())
    weights, experts = moe_group_routing(logits, router.e_score_correction_bias, router.top_k, router.num_group,
                                         router.topk_group, layout.normalize(router), router.routed_scaling_factor)
    return logits, weights, experts


# MoeLayout.routing -> (layout, router, hidden [T, H]) -> (router logits, weights [T, k], experts [T, k]).
ROUTINGS = {"softmax": _softmax_routing, "grouped_sigmoid": _grouped_sigmoid_routing}


def router_forward(layout):
    """The router forward of one family: (router logits, routing weights, expert indices), as stock."""
    routing = ROUTINGS[layout.routing]

    def forward(self, hidden_states: torch.Tensor):
        return routing(layout, self, hidden_states.reshape(-1, self.hidden_dim))
    return forward


def shared_expert_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A sparse block with a shared expert (Qwen2-MoE): routed experts + sigmoid(shared_expert_gate(x)) *
    shared_expert(x). The sigmoid is taken as softmax([g, 0])[0] in fp32, one reduction per row: on CPU
    an elementwise fp32 sigmoid rounds differently in the vectorized body and in the scalar tail, and
    where a token lands in the tensor depends on the batch (measured: 158 of 4000 values differed
    between alone and in one tensor; softmax per row: none)."""
    batch, length, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)
    shared = self.shared_expert(x)
    _, weights, experts = self.gate(x)
    routed = self.experts(x, experts, weights)
    gate = self.shared_expert_gate(x).float()
    gate = torch.softmax(torch.cat([gate, torch.zeros_like(gate)], dim=-1), dim=-1)[:, :1]
    return (routed + gate.to(shared.dtype) * shared).reshape(batch, length, hidden)


def shared_experts_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A sparse block with an ungated shared MLP (GLM-4.5, DeepSeek-V3): routed experts + shared_experts(x),
    the routed output cast to the hidden dtype before the add, as stock."""
    batch, length, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)
    _, weights, experts = self.gate(x)
    routed = self.experts(x, experts, weights)
    return (routed + self.shared_experts(x)).reshape(batch, length, hidden)


def sparse_block_forward(layout):
    """The block forward make_invariant installs for a layout, or None where stock's block forward stays."""
    if layout.shared_expert:
        return shared_expert_block_forward
    return shared_experts_block_forward if layout.ungated_shared_experts else None


def _check_shared_expert(adapter, block: nn.Module, where: str, quantized) -> None:
    shared, gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    if type(shared) is not adapter.mlp:
        raise UnsupportedModelError(f"{where}.shared_expert is {type(shared).__name__}, not {adapter.mlp.__name__}")
    for name, proj in [(f"shared_expert.{n}", getattr(shared, n, None)) for n in adapter.mlp_projections] + \
            [("shared_expert_gate", gate)]:
        if type(proj) is not nn.Linear and proj not in quantized:
            raise UnsupportedModelError(f"{where}.{name} is {type(proj).__name__}; only plain torch.nn.Linear "
                                        "layers and quantized checkpoints' layers are supported")
    if gate.out_features != 1:
        raise UnsupportedModelError(f"{where}.shared_expert_gate has {gate.out_features} outputs; expected 1")


def _check_shared_experts(adapter, block: nn.Module, where: str, quantized) -> None:
    shared = getattr(block, "shared_experts", None)
    if type(shared) is not adapter.mlp:
        raise UnsupportedModelError(f"{where}.shared_experts is {type(shared).__name__}, not {adapter.mlp.__name__}")
    for name in adapter.mlp_projections:
        proj = getattr(shared, name, None)
        if type(proj) is not nn.Linear and proj not in quantized:
            raise UnsupportedModelError(f"{where}.shared_experts.{name} is {type(proj).__name__}; only plain "
                                        "torch.nn.Linear layers and quantized checkpoints' layers are supported")


def check_sparse_block(adapter, block: nn.Module, where: str, quantized_experts=(),
                       quantized_layers=()) -> None:
    """Refuse a sparse MoE block the invariant forwards do not compute exactly. Experts in
    ``quantized_experts`` (checked by ``model.quantized_experts``) and quantized shared-expert
    layers in ``quantized_layers`` are accepted as they are."""
    layout = adapter.moe
    router, experts = getattr(block, layout.router_attribute, None), getattr(block, "experts", None)
    if type(router) is not layout.router:
        raise UnsupportedModelError(f"{where}.{layout.router_attribute} is {type(router).__name__}, not the "
                                    f"{layout.router.__name__} router the invariant routing replaces")
    if layout.shared_expert:
        _check_shared_expert(adapter, block, where, quantized_layers)
    if layout.ungated_shared_experts:
        _check_shared_experts(adapter, block, where, quantized_layers)
    if getattr(experts, "_is_expert_parallel", False):
        raise UnsupportedModelError(f"{where}.experts is expert-parallel: expert parallelism is not supported "
                                    "(load the model on one device)")
    if experts not in quantized_experts:
        _check_dense_experts(layout, experts, where)
    hidden = experts.gate_up_proj.shape[1 if layout.activation == "clamped_swiglu" else 2]
    if router.weight.shape != (experts.num_experts, hidden):
        raise UnsupportedModelError(f"{where}.{layout.router_attribute}.weight has shape {tuple(router.weight.shape)}; "
                                    f"expected ({experts.num_experts}, {hidden})")


def _check_dense_experts(layout, experts: nn.Module, where: str) -> None:
    if type(experts) is not layout.experts:
        raise UnsupportedModelError(f"{where}.experts is {type(experts).__name__}, not {layout.experts.__name__} "
                                    "(replaced experts are not supported; quantized ones are in transformers' fp8 format, "
                                    "FP8Experts)")
    expected = _EXPERT_LAYOUTS[layout.activation]
    for name, value in expected.items():
        if getattr(experts, name, value) != value:
            raise UnsupportedModelError(f"{where}.experts has {name}={getattr(experts, name)}; the invariant experts "
                                        f"compute the layout {expected}")
    biases = ("gate_up_proj_bias", "down_proj_bias") if expected["has_bias"] else ()
    for name in ("gate_up_proj", "down_proj") + biases:
        weight = getattr(experts, name, None)
        if type(weight) is not nn.Parameter or weight.dim() != (2 if name in biases else 3):
            raise UnsupportedModelError(f"{where}.experts.{name} is not a {2 if name in biases else 3}-D parameter "
                                        "(packed experts outside transformers' fp8 format are not supported)")


def register() -> None:
    """Register the experts function; global registration selects nothing until a model asks for it."""
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, invariant_experts_forward)
