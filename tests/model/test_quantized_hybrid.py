"""Quantized hybrid checkpoints (Qwen3.5's text model, compressed-tensors FP8 in 128x128 blocks and
int4 weights in groups of 128): loaded with from_pretrained and kept compressed, each row's logits bitwise those of
the row alone, and (FP8 blocks) the engine's outputs those of each request alone. The block format leaves the
Gated DeltaNet's in_proj_a / in_proj_b dense (their 4 outputs make no 128-row block), as a checkpoint
that cannot block them must. Negative control: a per-tensor activation scale (the batch's max) on the
layers' own quantized GEMM changes rows with their batch. The hybrid MoE families in transformers'
``fp8`` format (experts in 128x128 fp8 blocks, as for the other MoE families): rows and engine
requests equal alone, experts kept in fp8; compressed-tensors MoE checkpoints are refused by name."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.controls import per_tensor_scaled_quantized_forward
from helpers.models import BATCHINGS, batch_mismatches, make_samples
from invariant_infer import UnsupportedModelError, make_invariant
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model import quantization
from invariant_infer.model.quantization import quantized_layers
from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint, save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import random_config

import compressed_tensors  # noqa: E402,F401  (the test extra pins it: a missing install fails, never skips)

# Every projection's K a multiple of 128, and every N too but in_proj_a / in_proj_b (4 value heads).
WIDTHS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
# FP8 per channel runs the same quantized GEMM as FP8 blocks with another scale layout (the dense
# families' tests run it): the 128x128 blocks and int4 groups suffice here (CI time).
FORMATS = {"FP8_BLOCK": ("lm_head", "re:.*in_proj_a$", "re:.*in_proj_b$"), "W4A16": ("lm_head",)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    config = random_config("qwen3_5_text", "tiny", **WIDTHS)
    return {fmt: save_quantized_checkpoint(tmp_path_factory.mktemp(fmt), config, fmt, ignore=ignore)
            for fmt, ignore in FORMATS.items()}


def load(path):
    return make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval())


@pytest.mark.heavy  # the fast tier runs quantized layers in tests/model/test_quantized_checkpoints.py
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_equal_alone(checkpoints, fmt):
    model = load(checkpoints[fmt])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(quantized_layers(model)) == len(linears) - len(FORMATS[fmt])  # in_proj_a/b per layer: 1 GDN layer
    # Four batchings (left and right padding, extra padding, inputs_embeds): CI time.
    assert batch_mismatches(model, make_samples(model.config.vocab_size, (9, 1, 20, 5)), BATCHINGS[:4]) == []


@pytest.mark.heavy  # the engine runs each format's layers as the model does: one format suffices
def test_engine_requests_equal_alone(checkpoints):
    assert_engine_requests_equal_alone(load(checkpoints["FP8_BLOCK"]))


def assert_engine_requests_equal_alone(model) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (70, 3, 20)]
    params = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    alone = [Engine(model).generate([prompt], params)[0] for prompt in prompts]
    mixed = Engine(model, max_num_seqs=2, max_num_batched_tokens=13).generate(prompts, params)
    for a, b in zip(alone, mixed):
        assert (a.token_ids, a.logprobs, a.prompt_logprobs) == (b.token_ids, b.logprobs, b.prompt_logprobs)


# The official FP8 MoE checkpoints' format; the routers, the shared-expert gate and the Gated
# DeltaNet's small a / b projections (no whole 128-row block) stay in bf16.
FP8_MOE_WIDTHS = dict(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=4,
                      moe_intermediate_size=128, shared_expert_intermediate_size=128, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
FP8_MOE_DENSE = ["lm_head", "mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b", "in_proj_ba"]


@pytest.mark.heavy  # the fast tier runs fp8 experts in tests/model/test_quantized_moe.py
@pytest.mark.parametrize("family", ["qwen3_next"])  # Qwen3.5-MoE's layers are the same but the fused projections
def test_fp8_experts_rows_and_engine_requests_equal_alone(tmp_path, family):
    path = save_fp8_checkpoint(tmp_path / family, random_config(family, "tiny", **FP8_MOE_WIDTHS), seed=5,
                               dtype=torch.bfloat16, modules_to_not_convert=FP8_MOE_DENSE)
    with quantized_loading():
        model = make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval())
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert all(e.gate_up_proj.dtype == torch.float8_e4m3fn for e in experts)
    assert all(e.__dict__["forward"].__func__.__name__ == "quantized_experts_forward" for e in experts)
    assert batch_mismatches(model, make_samples(model.config.vocab_size, (9, 1, 20, 5)), BATCHINGS[:4]) == []
    if family == "qwen3_next":  # the engine runs the experts as the model does: one family suffices
        assert_engine_requests_equal_alone(model)


@pytest.mark.heavy
def test_negative_control_a_per_tensor_activation_scale(checkpoints, monkeypatch):
    model = load(checkpoints["FP8_BLOCK"])
    monkeypatch.setattr(quantization, "_quantized_forward", per_tensor_scaled_quantized_forward)
    assert batch_mismatches(model, make_samples(model.config.vocab_size, (9, 1, 70, 5))) != []


def test_compressed_tensors_experts_are_refused_by_name(tmp_path):
    config = random_config("qwen3_5_moe_text", "tiny", **{k: v for k, v in WIDTHS.items() if k != "intermediate_size"},
                           moe_intermediate_size=128, shared_expert_intermediate_size=128)
    path = save_quantized_checkpoint(tmp_path / "moe", config, "FP8_DYNAMIC")
    with pytest.raises(UnsupportedModelError, match="compressed-tensors mixture-of-experts"):
        load(path)
