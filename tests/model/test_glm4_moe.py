"""GLM-4.5 (glm4_moe): a dense first layer and a sparse one whose router is DeepSeek-V3's (sigmoid
scores, a selection bias, 2 groups of 4 experts with one kept, routed_scaling_factor 2.5), an
ungated shared MLP, q/k/v bias, per-head q/k norms and RoPE on half of each head. Each row is
bitwise itself alone in any padded batch and packed; fp32 logits are within tolerance of stock
float64, which references without the selection bias, without the routed scaling or with RoPE on
the whole head all miss by 10x; ``generate`` gives each row's bits alone and each step one
forward's; the engine's requests equal alone with prefix hits, and ``token_logprobs`` equal the
engine's logprobs; transformers' fp8 checkpoints keep their experts in fp8 and stay invariant.
Negative control: a batch-dependent expert GEMM. Tensor parallelism and training are refused by
name (the support table's MoE row). The engine schedule (chunked prefill, preemption, ``generate``,
``score_sequences``) runs it in tests/engine/test_engine.py."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.controls import m_dependent_grouped_linear
from helpers.engine_runs import trainer_logprobs
from helpers.models import BATCHINGS, batch_mismatches, load_model, logits_and_chosen_experts, make_samples
from invariant_infer import UnsupportedModelError, make_invariant, restore
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model import experts as experts_module
from invariant_infer.model.checks import check_model
from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint
from test_sliding_window import (assert_engine_requests_equal_alone_with_prefix_hits,
                                 assert_generate_past_the_window_equals_prefill_and_alone,
                                 assert_rows_equal_alone_in_any_batch_and_packed)

FAMILY = "glm4_moe"
LENGTHS = (9, 1, 14, 5)
RELATIVE_TOLERANCE = 2e-4  # max |logit - stock float64's| / max |stock float64's logit|


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("glm4_moe"), random_config(FAMILY, "tiny"), seed=1)


def test_the_layers_are_patched_as_the_layout_says(checkpoint):
    """Layer 0 dense, layer 1 sparse: the router runs moe_group_routing with the checkpoint's nonzero
    bias, the block adds the shared MLP unscaled, and restore gives back stock's forwards."""
    model = make_invariant(load_model(checkpoint, torch.float32))
    dense, sparse = (layer.mlp for layer in model.model.layers)
    assert type(dense).__name__ == "Glm4MoeMLP" and type(sparse).__name__ == "Glm4MoeMoE"
    assert vars(sparse)["forward"].__func__ is experts_module.shared_experts_block_forward
    assert "forward" in vars(sparse.gate) and "forward" in vars(sparse.shared_experts)
    assert sparse.gate.e_score_correction_bias.abs().min() > 0
    x = torch.randn(6, model.config.hidden_size)
    with torch.no_grad():
        logits, weights, experts = sparse.gate(x)
        stock_logits, stock_weights, stock_experts = type(sparse.gate).forward(sparse.gate, x)
    assert logits.dtype == weights.dtype == torch.float32
    order = stock_experts.sort(-1)
    assert torch.equal(experts.sort(-1).values, order.values)
    assert (weights.gather(1, experts.sort(-1).indices) - stock_weights.gather(1, order.indices)).abs().max() < 1e-6
    assert bool((experts // 4 == experts[:, :1] // 4).all())  # topk_group 1: every expert from one group of 4
    restore(model)
    assert "forward" not in vars(sparse) and "forward" not in vars(sparse.gate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.heavy),
                                   pytest.param(torch.float16, marks=pytest.mark.heavy)])
def test_rows_equal_alone_in_any_batch_and_packed(checkpoint, dtype):
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoint, dtype)), LENGTHS)


def test_negative_control_a_batch_dependent_expert_gemm(checkpoint, monkeypatch):
    model = make_invariant(load_model(checkpoint, torch.float32))  # bf16 rounding can hide a reordered sum
    monkeypatch.setattr(experts_module, "grouped_linear", m_dependent_grouped_linear)
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size, LENGTHS), BATCHINGS[:2]) != []


def _float64_reference(stock, change=None):
    reference = copy.deepcopy(stock).double()
    reference.set_experts_implementation("eager")  # grouped_mm has no float64
    if change is not None:
        change(reference)
    return reference


def _no_selection_bias(reference):
    for layer in reference.model.layers[reference.config.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.zero_()


def _no_routed_scaling(reference):
    for layer in reference.model.layers[reference.config.first_k_dense_replace:]:
        layer.mlp.gate.routed_scaling_factor = 1.0


def _whole_head_rotary(reference):
    config = reference.config
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 1.0}
    rotary = type(reference.model.rotary_emb)(config)
    reference.model.rotary_emb = rotary.to(torch.float64)


def test_accuracy_against_float64_and_what_its_tolerance_catches(checkpoint):
    stock = load_model(checkpoint, torch.float32)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(model.config.vocab_size, (40,))[0][None]
    with torch.no_grad():
        got = model(ids).logits.double()

        def error(change=None):
            want = _float64_reference(stock, change)(ids).logits
            return (got - want).abs().max().item() / want.abs().max().item()
        assert error() < RELATIVE_TOLERANCE
        for change in (_no_selection_bias, _no_routed_scaling, _whole_head_rotary):
            assert error(change) > 10 * RELATIVE_TOLERANCE, change.__name__


@pytest.mark.heavy
def test_bf16_error_at_most_twice_stock_bf16_error(checkpoint):
    ids = torch.stack(make_samples(512, (30, 30, 30)))
    with torch.no_grad():
        want = _float64_reference(load_model(checkpoint, torch.float32))(ids).logits
        stock = load_model(checkpoint, torch.bfloat16)(ids).logits.double()
        got = make_invariant(load_model(checkpoint, torch.bfloat16))(ids).logits.double()
    stock_error, error = ((x - want).norm() / want.norm() for x in (stock, got))
    assert 0 < error <= 2 * stock_error, (error, stock_error)


@pytest.mark.heavy  # generate's surface is the families' own (tests/generation); the fast tier runs this forward
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_equals_prefill_and_alone(checkpoint, cache):
    assert_generate_past_the_window_equals_prefill_and_alone(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                             cache, new_tokens=4)


@pytest.mark.heavy  # the fast tier's engine runs dense and softmax-routed MoE families (tests/engine)
def test_engine_requests_equal_alone_with_prefix_hits(checkpoint):
    assert_engine_requests_equal_alone_with_prefix_hits(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                        new_tokens=4)


@pytest.mark.heavy
def test_token_logprobs_equal_the_engines(checkpoint):
    """The trainer-side ``token_logprobs`` (no grad: MoE layers do not train) equal the engine's
    sampled-token logprobs in a right-padded micro-batch."""
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (26, 2, 13)]
    params = [SamplingParams(max_tokens=3 + i, temperature=0.7, seed=i, ignore_eos=True,
                             logprobs_mode="processed_logprobs") for i in range(len(prompts))]
    outs = Engine(model, max_num_seqs=2, max_num_batched_tokens=16).generate(prompts, params)
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]
    prompt_lengths = [len(o.prompt_token_ids) for o in outs]
    with torch.no_grad():
        assert trainer_logprobs(model, sequences, prompt_lengths, 3, "right", 0.7) == [o.logprobs for o in outs]


def test_air_shape_without_qk_norms_and_the_refusals_by_name():
    """GLM-4.5-Air has no q/k norms: its layers are accepted without them. Tensor parallelism and
    training are refused by the support table's MoE row."""
    air = random_model(random_config(FAMILY, "tiny", use_qk_norm=False, n_group=1, topk_group=1))
    assert not hasattr(air.model.layers[0].self_attn, "q_norm")
    check_model(air)
    with pytest.raises(UnsupportedModelError, match="tensor parallelism does not run mixture-of-experts"):
        check_model(air, sharded=True)
    model = make_invariant(air)
    with torch.enable_grad(), pytest.raises(UnsupportedModelError, match="MoE training is not supported"):
        model(torch.arange(5)[None])


@pytest.mark.heavy
def test_fp8_checkpoint_keeps_fp8_experts_and_rows_equal_alone(tmp_path):
    """transformers' fp8 format (128 x 128 blocks, as GLM's FP8 releases): experts and linear layers stay
    fp8, the router stays fp32, rows are bitwise alone in any batch, and the logits stay near the
    dequantized model's in float64 (activations are quantized per 128-group on the fp8 path)."""
    config = random_config(FAMILY, "tiny", hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                           num_key_value_heads=4)
    path = save_fp8_checkpoint(tmp_path / "fp8", config, seed=5, dtype=torch.bfloat16)
    with quantized_loading():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    sparse = model.model.layers[1].mlp
    assert type(sparse.experts).__name__ == "FP8Experts" and sparse.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert type(sparse.shared_experts.down_proj).__name__ == "FP8Linear"
    make_invariant(model)
    samples = make_samples(model.config.vocab_size, LENGTHS)
    reference = _float64_reference(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    with torch.no_grad():
        assert batch_mismatches(model, samples, BATCHINGS[:2]) == []
        ids = samples[2][None]
        got, got_experts = logits_and_chosen_experts(model, ids)
        want, want_experts = logits_and_chosen_experts(reference, ids)
    # A token whose experts differ (a near tie the quantized activations tip) is left out; flips stay rare.
    same = (got_experts == want_experts).all(-1)
    assert same.float().mean() >= 0.75
    assert (got - want)[same].abs().max() / want.abs().max() < 0.08  # as the other MoE families' fp8 bound

