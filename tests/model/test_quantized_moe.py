"""Quantized mixture-of-experts checkpoints: transformers' ``fp8`` format with its experts in 128x128
fp8 blocks (``FP8Experts``, as the official Qwen3 MoE FP8 checkpoints), loaded with from_pretrained,
kept in fp8 and bitwise batch-invariant in every MoE family; compressed-tensors MoE checkpoints refused.

The reference for the dequantization is transformers' own: without a GPU, a plain load dequantizes
the checkpoint (experts included) to the float dtype."""
import copy
import json
import types
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.models import batch_mismatches, make_samples
from invariant_infer import make_invariant, restore
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.kernels import dequantize_weight, grouped_quantized_linear, silu_mul
from invariant_infer.model.experts import routed_forward
from invariant_infer.model.quantization import weight_bytes
from invariant_infer.model.quantized_experts import quantized_experts
from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint, save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import random_config
from invariant_infer.model.module_state import state_of

pytestmark = pytest.mark.file_minutes(1.0)

_ATTENTION = dict(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                  vocab_size=512)
# Every expert width a multiple of 128 (the blocks); Qwen2-MoE's shared-expert gate (one output) stays dense.
FAMILIES = {
    "qwen3_moe": (dict(_ATTENTION, moe_intermediate_size=128), torch.bfloat16, None),
    "mixtral": (dict(_ATTENTION, intermediate_size=128), torch.float16, None),
    "qwen2_moe": (dict(_ATTENTION, moe_intermediate_size=128, shared_expert_intermediate_size=128), torch.bfloat16,
                  ["lm_head", "shared_expert_gate"]),
}
# Max |logit - float64 reference| / max |reference|; the reference has the dequantized weights but
# full-precision activations, which the fp8 path quantizes to e4m3 per 128-group (as in
# test_quantized_fp8_format).
LOGIT_TOLERANCE = 0.08


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-moe")
    return {family: save_fp8_checkpoint(root / family, random_config(family, "tiny", **config), seed=5, dtype=dtype,
                                        modules_to_not_convert=skip)
            for family, (config, dtype, skip) in FAMILIES.items()}


def _load(path, dtype):
    with quantized_loading():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _experts_modules(model):
    return [layer.mlp.experts for layer in model.model.layers]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_bitwise_equal_alone_and_in_any_batch(checkpoints, family):
    dtype = FAMILIES[family][1]
    model = make_invariant(_load(checkpoints[family], dtype))
    experts = _experts_modules(model)
    assert all(type(e).__name__ == "FP8Experts" and e.gate_up_proj.dtype == torch.float8_e4m3fn for e in experts)
    assert all(e.__dict__["forward"].__func__.__name__ == "quantized_experts_forward" for e in experts)
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size)) == []


def test_weights_stay_fp8_and_take_less_memory(checkpoints):
    model = _load(checkpoints["qwen3_moe"], torch.bfloat16)
    stored = weight_bytes(model)
    make_invariant(model)
    with torch.no_grad():
        model(torch.arange(5)[None])
    assert weight_bytes(model) == stored
    dense = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=torch.bfloat16)
    assert type(dense.model.layers[0].mlp.experts).__name__ != "FP8Experts"  # transformers dequantized it
    assert stored < weight_bytes(dense)
    experts_bytes = lambda m: sum(p.numel() * p.element_size() for e in _experts_modules(m) for p in e.parameters())  # noqa: E731
    assert experts_bytes(model) < 0.52 * experts_bytes(dense)  # 1 byte a weight, plus one fp32 scale per block
    assert not any(p.requires_grad for e in _experts_modules(model) for p in e.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_dequantization_equals_transformers_and_logits_match_float64(checkpoints, family):
    dtype = FAMILIES[family][1]
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=dtype).eval()
    model = _load(checkpoints[family], dtype)
    plans = quantized_experts(model)
    assert len(plans) == model.config.num_hidden_layers
    for layer, ref_layer in zip(model.model.layers, reference.model.layers):
        plan, dense = plans[layer.mlp.experts], ref_layer.mlp.experts
        for e in range(dense.num_experts):
            assert torch.equal(_dequantized(plan.gate_up.expert(e), dtype), dense.gate_up_proj[e].data)
            assert torch.equal(_dequantized(plan.down.expert(e), dtype), dense.down_proj[e].data)
    ref64 = copy.deepcopy(reference).double()
    ref64.set_experts_implementation("eager")  # grouped_mm takes no float64
    make_invariant(model)
    ids = torch.stack(make_samples(model.config.vocab_size, lengths=(12, 12)))
    with torch.no_grad():
        (got, got_experts), (want, want_experts) = _logits_and_routing(model, ids), _logits_and_routing(ref64, ids)
    # A token whose top-k differs (a near tie the quantized activations tip) takes other experts:
    # compare the others, and require that such flips stay rare.
    same = (got_experts == want_experts).all(-1).reshape(ids.shape)
    assert same.float().mean() >= 0.75
    error = (got - want).abs().amax(-1)[same].max() / want.abs().max()
    assert error.item() < LOGIT_TOLERANCE  # measured 0.038 (qwen3_moe, bf16), 0.031 (mixtral, fp16)


def _dequantized(weight, dtype):
    """fp8 x scale in fp32 (exact), rounded once to ``dtype``, as transformers dequantizes; the
    scales are fp32 under transformers 5.24 and the checkpoint's bf16 under 5.17."""
    return dequantize_weight(replace(weight, scale=weight.scale.float())).to(dtype)


def _logits_and_routing(model, ids):
    """(logits in float64, each token's chosen experts in every layer, sorted)."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2].sort(-1).values))
             for layer in model.model.layers]
    try:
        logits = model(ids).logits.double()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.cat(chosen, dim=-1)


def _per_tensor(x):
    """One fp8 scale over every routed row (stock fused-MoE FP8, vLLM #57016), in 128-groups' layout."""
    scale = (x.float().abs().amax() / 448).clamp(min=1e-12)
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.reshape(1, 1).expand(x.shape[0], x.shape[1] // 128).contiguous()


def _per_tensor_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    plan = state_of(self).quantized
    intermediate = plan.down.shape[1]

    def run_sorted(tokens, offsets):
        q, scale = _per_tensor(hidden_states[tokens])
        gate_up = grouped_quantized_linear(q, plan.gate_up, offsets, x_scale=scale, out_dtype=hidden_states.dtype)
        hq, h_scale = _per_tensor(silu_mul(gate_up[:, :intermediate], gate_up[:, intermediate:]))
        return grouped_quantized_linear(hq, plan.down, offsets, x_scale=h_scale, out_dtype=hidden_states.dtype)
    return routed_forward(hidden_states, top_k_index, top_k_weights, self.num_experts, run_sorted)


@pytest.mark.heavy
def test_negative_control_per_tensor_activation_scale_in_the_experts_is_caught(checkpoints):
    model = make_invariant(_load(checkpoints["qwen3_moe"], torch.bfloat16))
    for experts in _experts_modules(model):
        experts.forward = types.MethodType(_per_tensor_experts_forward, experts)
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size))


def test_restore_gives_back_transformers_experts(checkpoints):
    model = make_invariant(_load(checkpoints["qwen3_moe"], torch.bfloat16))
    restore(model)
    experts = model.model.layers[0].mlp.experts
    assert "forward" not in experts.__dict__ and state_of(experts) is None


def _with_experts(model, **fields):
    for experts in _experts_modules(model):
        for key, value in fields.items():
            setattr(experts, key, value)
    return model


@pytest.mark.parametrize("mutate,match", [
    (lambda m: _with_experts(m, activation_scheme="static"), "static activation scales"),
    (lambda m: _with_experts(m, block_size=[64, 64]), r"weight blocks \[64, 64\]"),
    (lambda m: _with_experts(m, limit=7.0), "limit=7.0"),
    (None, "bf16 or fp16"),
])
def test_refusals_name_the_problem_and_the_supported_format(checkpoints, mutate, match):
    path = checkpoints["qwen3_moe"]
    model = _load(path, torch.float32) if mutate is None else mutate(_load(path, torch.bfloat16))
    with pytest.raises(UnsupportedModelError, match=match) as refused:
        make_invariant(model)
    assert "[128, 128] weight blocks" in str(refused.value)


def test_compressed_tensors_moe_checkpoints_are_refused(tmp_path):
    """transformers decompresses a compressed-tensors MoE model's quantized experts at load: any
    compressed-tensors MoE checkpoint is refused by name, never run as if its experts were quantized."""
    path = save_quantized_checkpoint(tmp_path / "ct", random_config("qwen3_moe", "tiny", **FAMILIES["qwen3_moe"][0]),
                                     "FP8_DYNAMIC")
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    with pytest.raises(UnsupportedModelError, match="decompresses their experts"):
        make_invariant(_load(path, torch.bfloat16))


@pytest.mark.gpu
def test_gpu_load_keeps_fp8_experts_and_rows_are_invariant(checkpoints):
    """On a GPU transformers keeps FP8Experts by itself (no context needed)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=torch.bfloat16,
                                                 device_map="cuda").eval()
    model = make_invariant(model)
    assert all(type(e).__name__ == "FP8Experts" for e in _experts_modules(model))
    samples = [s.cuda() for s in make_samples(model.config.vocab_size)]
    with torch.no_grad():
        assert batch_mismatches(model, samples) == []
