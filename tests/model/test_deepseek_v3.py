"""DeepSeek-V3: multi-head latent attention run absorbed (the query through W_uk, one shared [latent,
rope key] per token as key and value, the output through W_uv, per-head products on the grouped GEMM),
interleaved yarn RoPE, the latent cached, a dense first layer and a sparse one (group-limited sigmoid
router with a selection bias and a routed scaling factor, routed experts plus an unscaled shared MLP).
Each row is bitwise itself alone in any padded batch (left, right, ``inputs_embeds``) and packed; fp32
logits are within tolerance of stock float64 (which expands K and V), while references with the rope
on the other layout, without yarn's mscale, without the routing bias or without the routed scaling
miss; bf16 stays within twice stock bf16's error; ``generate`` gives each row's bits alone and
each step one forward's, with transformers' dynamic and static caches holding the latent; the engine's
pages hold one latent vector per token and its requests equal alone with prefix hits, ``generate``,
``token_logprobs`` and ``score_sequences``.
Negative control: a batch-dependent per-head GEMM. Tensor parallelism, training, quantized checkpoints
other than transformers' fp8 and the stock engine are refused by name."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from helpers.controls import m_dependent_grouped_linear
from helpers.engine_runs import trainer_logprobs
from helpers.models import BATCHINGS, batch_mismatches, load_model, make_samples
from invariant_infer import UnsupportedModelError, make_invariant, score_sequences
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.engine.kv_cache_layout import kv_cache_layout
from invariant_infer.model import latent_attention
from invariant_infer.model.cache_specs import LatentAttentionSpec, cache_specs
from invariant_infer.model.checks import check_model
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint
from test_sliding_window import (assert_engine_requests_equal_alone_with_prefix_hits,
                                 assert_generate_past_the_window_equals_prefill_and_alone,
                                 assert_rows_equal_alone_in_any_batch_and_packed)

FAMILY = "deepseek_v3"
LENGTHS = (9, 1, 70, 5)  # 70: two 64-key blocks
SHORT_LENGTHS = (9, 1, 20, 5)  # the fast tier's (CI time)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("deepseek_v3"), random_config(FAMILY, "tiny"), seed=1)


@pytest.mark.parametrize("dtype, lengths", [(torch.bfloat16, SHORT_LENGTHS),
                                            pytest.param(torch.float32, LENGTHS, marks=pytest.mark.heavy),
                                            pytest.param(torch.float16, SHORT_LENGTHS, marks=pytest.mark.heavy)],
                         ids=["bf16", "fp32", "fp16"])
def test_rows_equal_alone_in_any_batch_and_packed(checkpoint, dtype, lengths):
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoint, dtype)), lengths)


def test_negative_control_a_batch_dependent_per_head_gemm(checkpoint, monkeypatch):
    model = make_invariant(load_model(checkpoint, torch.float32))  # bf16 rounding can hide a reordered sum
    monkeypatch.setattr(latent_attention, "grouped_linear", m_dependent_grouped_linear)
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size, SHORT_LENGTHS), BATCHINGS[:1]) != []


def _errors_against_float64(checkpoint, dtype, changes=()):
    """(max |logit - stock float64's| of the invariant model in ``dtype``, of stock in ``dtype``, the
    float64 logits' max |value|, and the invariant model's error against each changed reference)."""
    stock = load_model(checkpoint, torch.float32)
    model = make_invariant(copy.deepcopy(stock).to(dtype))
    ids = make_samples(stock.config.vocab_size, (100,))[0][None]

    def reference(change=None):
        ref = copy.deepcopy(stock).double()
        ref.set_experts_implementation("eager")  # grouped_mm has no float64
        if change is not None:
            change(ref)
        return ref(ids).logits
    with torch.no_grad():
        exact, ours = reference(), model(ids).logits.double()
        theirs = copy.deepcopy(stock).to(dtype)(ids).logits.double()
        missed = [(ours - reference(change)).abs().max().item() for change in changes]
    return (ours - exact).abs().max().item(), (theirs - exact).abs().max().item(), exact.abs().max().item(), missed


def test_accuracy_against_float64_and_what_its_tolerance_catches(checkpoint):
    def rope_not_interleaved(reference):
        reference.config.rope_interleave = False

    def no_yarn_mscale(reference):
        for layer in reference.model.layers:
            layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5

    def no_routing_bias(reference):
        for layer in reference.model.layers[reference.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.zero_()

    def no_routed_scaling(reference):
        for layer in reference.model.layers[reference.config.first_k_dense_replace:]:
            layer.mlp.gate.routed_scaling_factor = 1.0

    changes = (rope_not_interleaved, no_yarn_mscale, no_routing_bias, no_routed_scaling)
    error, _, scale, missed = _errors_against_float64(checkpoint, torch.float32, changes)
    tolerance = 2e-4 * scale
    assert error < tolerance
    for change, miss in zip(changes, missed):
        assert miss > 10 * tolerance, change.__name__


@pytest.mark.heavy
def test_bf16_error_is_at_most_twice_stock_bf16s(checkpoint):
    ours, stock, _, _ = _errors_against_float64(checkpoint, torch.bfloat16)
    assert ours <= 2 * stock


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.heavy)])
def test_generate_equals_prefill_and_alone_with_the_latent_cached(checkpoint, cache):
    """Each row alone and each step one forward; transformers' cache holds the latent and the rope key
    (one head of kv_lora_rank and of qk_rope_head_dim), not expanded K/V."""
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    assert_generate_past_the_window_equals_prefill_and_alone(model, cache, new_tokens=4, lengths=(20, 5, 12))
    ids = torch.tensor([[5, 6, 7]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True, cache_implementation=cache)
    layer = out.past_key_values.layers[0]
    config = model.config
    assert layer.keys.shape[1:2] == layer.values.shape[1:2] == (1,)
    assert (layer.keys.shape[-1], layer.values.shape[-1]) == (config.kv_lora_rank, config.qk_rope_head_dim)


@pytest.mark.heavy
def test_engine_requests_equal_alone_generate_and_the_trainers_logprobs(checkpoint):
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    assert_engine_requests_equal_alone_with_prefix_hits(model, new_tokens=4)
    prompts = [s.tolist() for s in make_samples(model.config.vocab_size, (66, 2, 30), seed=5)]
    greedy = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)
    outs = Engine(model, max_num_seqs=2, max_num_batched_tokens=16).generate(prompts, greedy)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                   do_sample=False, pad_token_id=0)
        assert generated[0, len(prompt):].tolist() == out.token_ids
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]
    prompt_lengths = [len(o.prompt_token_ids) for o in outs]
    scores = score_sequences(model, sequences, prompt_lengths=prompt_lengths)
    assert [s.token_logprobs.tolist() for s in scores] == [o.logprobs for o in outs]
    with torch.no_grad():
        assert trainer_logprobs(model, sequences, prompt_lengths, 2, "left", 1.0) == [o.logprobs for o in outs]


def test_engine_pages_hold_one_latent_per_token(checkpoint):
    """An MLA layer's memory per token is (kv_lora_rank + qk_rope_head_dim) elements, one tensor read as K
    and V; DeepSeek-V3's published shape: 61 layers x 576 x 2 bytes = 70,272 bytes per token in bf16."""
    config = random_config(FAMILY, "tiny")
    assert set(cache_specs(config)) == {LatentAttentionSpec(1, 32 + 16)}
    layout = kv_cache_layout(config)
    assert layout.page_bytes(torch.bfloat16, 64) == 64 * 2 * (32 + 16) * 2
    assert layout.page_bytes(torch.float32, 64) == 64 * 2 * (32 + 16) * 4
    published = kv_cache_layout(random_config(FAMILY, "deepseek-v3"))
    assert published.page_bytes(torch.bfloat16, 1) == 61 * 576 * 2 == 70272
    runner = Engine(make_invariant(load_model(checkpoint, torch.bfloat16))).core.runner
    assert all(k is v and k.shape[2:] == (1, 48) for k, v in zip(runner.k_caches, runner.v_caches))


def test_tensor_parallelism_training_quantized_and_stock_engine_are_refused_by_name(checkpoint):
    with pytest.raises(UnsupportedModelError, match="tensor parallelism does not run"):
        check_model(random_model(random_config(FAMILY, "tiny")), sharded=True)
    quantized = random_config(FAMILY, "tiny", quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match="in quantized checkpoints other than transformers' fp8"):
        check_model(DeepseekV3ForCausalLM(quantized))  # transformers' fp8: test_deepseek_v3_fp8.py
    model = make_invariant(load_model(checkpoint, torch.float32))
    with torch.enable_grad(), pytest.raises(UnsupportedModelError, match="does not run multi-head latent attention"):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(UnsupportedModelError, match="kernels='stock'"):
        Engine(load_model(checkpoint, torch.float32), kernels="stock")
