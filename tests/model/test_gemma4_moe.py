"""Gemma 4's MoE variant (``gemma4_text`` with ``enable_moe_block``), the tiny-moe preset: the dense
tiny preset's features with 8 experts (top-2) beside each layer's dense MLP. Each row is bitwise
itself alone in a padded batch and packed; fp32 logits are within tolerance of stock float64, which
references without the per-expert scales or with the experts reading the dense MLP's norm miss;
bf16 errs no more than stock bf16; ``generate`` (dynamic and static caches) and the engine with prefix
hits give each row's bits alone; ``score_sequences`` and ``token_logprobs`` each sequence's logprobs of its
own forward in any batching. Quantized or replaced experts are refused by name before anything is
patched. Negative control: an M-dependent grouped expert GEMM."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers.controls import m_dependent_grouped_linear
from helpers.models import BATCHINGS, batch_mismatches, load_model, make_samples
from invariant_infer import make_invariant
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from test_audit import assert_stock_reported_and_patched_clean
from test_gemma4 import packed_rows_equal_alone
from test_sliding_window import (assert_engine_requests_equal_alone_with_prefix_hits,
                                 assert_generate_past_the_window_equals_prefill_and_alone)

FAMILY = "gemma4_text"
LENGTHS = (9, 1, 26, 5)  # past the 16-key window
RELATIVE_TOLERANCE = 2e-4  # of the logits' scale (their largest magnitude), fp32 against stock float64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("gemma4_moe"), random_config(FAMILY, "tiny-moe"), seed=1)


@pytest.mark.fast_cells(ids=["bfloat16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16],
                         ids=["bfloat16", "float32", "float16"])
def test_rows_equal_alone_in_a_padded_batch_and_packed(checkpoint, dtype):
    """A left-padded batch of ids, a right-padded one of embeddings, and packed rows."""
    model = make_invariant(load_model(checkpoint, dtype))
    samples = make_samples(model.config.vocab_size, LENGTHS)
    with torch.no_grad():
        assert batch_mismatches(model, samples, [BATCHINGS[0], BATCHINGS[3]]) == []
        assert packed_rows_equal_alone(model, samples)


@pytest.mark.heavy
def test_an_m_dependent_grouped_expert_gemm_is_caught(checkpoint, monkeypatch):
    """The invariance check fails once the experts' grouped GEMM picks BLOCK_K by its largest expert's rows."""
    import invariant_infer.model.experts as experts_module
    model = make_invariant(load_model(checkpoint, torch.float32))
    samples = make_samples(model.config.vocab_size, LENGTHS)
    monkeypatch.setattr(experts_module, "grouped_linear", m_dependent_grouped_linear)
    with torch.no_grad():
        assert batch_mismatches(model, samples, [BATCHINGS[0], BATCHINGS[3]]) != []


def _float64_reference(stock):
    reference = copy.deepcopy(stock).double()
    reference.set_experts_implementation("eager")  # grouped_mm takes no float64
    return reference


def _no_per_expert_scale(reference):
    for layer in reference.model.layers:
        layer.router.per_expert_scale.data.fill_(1.0)


def _experts_read_the_dense_norm(reference):
    for layer in reference.model.layers:
        layer.pre_feedforward_layernorm_2 = layer.pre_feedforward_layernorm


def test_accuracy_against_float64_and_what_its_tolerance_catches(checkpoint):
    stock = load_model(checkpoint, torch.float32)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(model.config.vocab_size, (60,))[0][None]

    def reference_logits(change=None):
        reference = _float64_reference(stock)
        if change is not None:
            change(reference)
        with torch.no_grad():
            return reference(ids, use_cache=False).logits  # no cache: the KV-shared layers own none
    exact = reference_logits()
    with torch.no_grad():
        ours = model(ids).logits.double()
    tolerance = RELATIVE_TOLERANCE * exact.abs().max().item()
    assert (ours - exact).abs().max().item() < tolerance
    for change in (_no_per_expert_scale, _experts_read_the_dense_norm):
        assert (ours - reference_logits(change)).abs().max().item() > 10 * tolerance, change.__name__


@pytest.mark.heavy
def test_bf16_errs_no_more_than_twice_stock_bf16(checkpoint):
    stock = load_model(checkpoint, torch.bfloat16)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(model.config.vocab_size, (60,))[0][None]
    with torch.no_grad():
        exact = _float64_reference(load_model(checkpoint, torch.float32))(ids, use_cache=False).logits
        ours = (model(ids).logits.double() - exact).abs().max().item()
        theirs = (stock(ids).logits.double() - exact).abs().max().item()
    assert ours <= 2 * theirs


@pytest.mark.heavy
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_past_the_window_equals_prefill_and_alone(checkpoint, cache):
    assert_generate_past_the_window_equals_prefill_and_alone(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                             cache, new_tokens=3)


@pytest.mark.heavy
def test_scoring_and_token_logprobs_are_batch_independent_and_equal_the_forward(checkpoint):
    """``score_sequences`` (every sequence alone, then packed) and the trainer-side ``token_logprobs``
    (left- and right-padded micro-batches) give each sequence's logprobs of its tokens, past the window,
    as the kernel gives them on that sequence's own forward logits (softcapped)."""
    from helpers.engine_runs import trainer_logprobs
    from invariant_infer import score_sequences
    from invariant_infer.kernels import token_logprobs
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    sequences = [s.tolist() for s in make_samples(model.config.vocab_size, (30, 3, 21, 9), seed=5)]
    prompts = [1, 2, 5, 1]
    with torch.no_grad():
        forward = [token_logprobs(model(input_ids=torch.tensor([seq])).logits[0, :-1].contiguous(),
                                  torch.tensor(seq[1:]))[0][p - 1:].tolist() for seq, p in zip(sequences, prompts)]
    alone = score_sequences(model, sequences, prompt_lengths=prompts, max_batch_tokens=1)
    packed = score_sequences(model, sequences, prompt_lengths=prompts, max_batch_tokens=1000, chunk_rows=3)
    assert [r.token_logprobs.tolist() for r in alone] == [r.token_logprobs.tolist() for r in packed] == forward
    with torch.no_grad():
        for side in ("left", "right"):
            assert trainer_logprobs(model, sequences, prompts, 3, side, 1.0) == forward, side


@pytest.mark.heavy
def test_engine_requests_equal_alone_with_prefix_hits(checkpoint):
    assert_engine_requests_equal_alone_with_prefix_hits(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                        new_tokens=4, alone_prompt_logprobs=True)


@pytest.mark.heavy
def test_the_multimodal_checkpoints_moe_text_model_runs_as_gemma4_text():
    """``gemma4`` (Gemma4ForConditionalGeneration) with a MoE text config, given text: each row of a
    batch is its bits alone and the same weights' Gemma4ForCausalLM's."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM
    from invariant_infer.model.families import FAMILIES
    from invariant_infer.model.kinds import config_kinds
    from invariant_infer.testing.random_checkpoints import random_model
    config = random_config("gemma4", "tiny", text_config=FAMILIES[FAMILY].presets["tiny-moe"])
    assert "moe" in config_kinds(config) and "dense" not in config_kinds(config)
    wrapper = random_model(config, seed=1, dtype=torch.bfloat16)
    text = Gemma4ForCausalLM(wrapper.config.text_config).eval().to(torch.bfloat16)
    state = {f"model.{name}": value for name, value in wrapper.model.language_model.state_dict().items()}
    text.load_state_dict({**state, "lm_head.weight": wrapper.lm_head.weight}, strict=True)
    model, text = make_invariant(wrapper), make_invariant(text)
    samples = make_samples(config.text_config.vocab_size, LENGTHS)
    with torch.no_grad():
        assert batch_mismatches(model, samples, [BATCHINGS[0]]) == []
        for sample in samples:
            assert torch.equal(model(input_ids=sample[None]).logits, text(input_ids=sample[None]).logits)


@pytest.mark.heavy
def test_the_strict_audit_finds_the_stock_experts_and_none_once_patched(checkpoint):
    assert_stock_reported_and_patched_clean(load_model(checkpoint, torch.bfloat16))


def _fp8_experts(config):
    from transformers.integrations.finegrained_fp8 import FP8Experts
    return FP8Experts(config=config, block_size=[128, 128], activation_scheme="dynamic")


def _packed_experts(experts):
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach().flatten(0, 1))  # [E * 2I, H]
    return experts


def _renamed_experts(experts):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
    experts.__class__ = type("ReplacedExperts", (Gemma4TextExperts,), {})
    return experts


@pytest.mark.parametrize("replace, match", [
    (lambda layer, config: _fp8_experts(config), "Gemma4TextRouter and FP8Experts"),
    (lambda layer, config: _renamed_experts(layer.experts), "Gemma4TextRouter and ReplacedExperts"),
    (lambda layer, config: _packed_experts(layer.experts), r"experts.gate_up_proj is not a 3-D parameter")],
    ids=["fp8", "replaced", "packed"])
def test_quantized_or_replaced_experts_are_refused_before_patching(replace, match):
    """make_invariant (and check_model) refuse the layer by name before patching anything, instead of the
    forward refusing it when called; a compressed-tensors checkpoint (experts decompressed at load) by
    the support table."""
    from invariant_infer import UnsupportedModelError, is_invariant
    from invariant_infer.model.checks import check_model
    from invariant_infer.testing.random_checkpoints import random_model
    model = random_model(random_config(FAMILY, "tiny-moe"))
    check_model(model)  # the stock experts pass
    model.model.layers[1].experts = replace(model.model.layers[1], model.config)
    for check in (check_model, make_invariant):
        with pytest.raises(UnsupportedModelError, match=rf"layers\.1: .*{match}"):
            check(model)
    assert not is_invariant(model) and "forward" not in vars(model.model.layers[0])


def test_compressed_tensors_checkpoints_are_refused_by_the_support_table():
    from invariant_infer import UnsupportedModelError
    from invariant_infer.testing.random_checkpoints import random_model
    model = random_model(random_config(FAMILY, "tiny-moe"))
    model.config.quantization_config = {"quant_method": "compressed-tensors"}
    with pytest.raises(UnsupportedModelError, match="compressed-tensors mixture-of-experts"):
        make_invariant(model)
