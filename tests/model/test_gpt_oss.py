"""gpt-oss with bf16/fp32 experts: a sliding layer (a window of 24 keys) and a full one, attention
sinks in both, yarn RoPE on the heads' halves, fp32-scaled norms, the router with bias and the
experts with interleaved gate/up, biases and the clamped SwiGLU. Each row is bitwise itself alone
in any padded batch and packed; fp32 logits are within tolerance of stock float64 (eager experts),
which references without the sinks, without the window, without the router bias or with another
SwiGLU alpha all miss; ``generate`` past the window (the dynamic sliding cache) gives each row's
bits alone and each step one forward's; the engine's requests equal alone with prefix hits, and
``token_logprobs`` equal the engine's logprobs.
Negative control: a batch-dependent expert GEMM. MXFP4 experts and tensor parallelism are refused
by name."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers.controls import m_dependent_grouped_linear
from helpers.engine_runs import trainer_logprobs
from helpers.models import BATCHINGS, batch_mismatches, load_model, make_samples
from invariant_infer import UnsupportedModelError, make_invariant
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model import experts as experts_module
from invariant_infer.model.checks import check_model
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint
from test_sliding_window import (assert_engine_requests_equal_alone_with_prefix_hits,
                                 assert_generate_past_the_window_equals_prefill_and_alone,
                                 assert_rows_equal_alone_in_any_batch_and_packed)

FAMILY = "gpt_oss"
LENGTHS = (9, 1, 40, 5)  # past the 24-key window
FP32_TOLERANCE = 1e-5  # max |logit - stock float64's|


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("gpt_oss"), random_config(FAMILY, "tiny"), seed=1)


# fp16: the sink, window and expert kernels' own tests run it (CI time).
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.heavy)])
def test_rows_equal_alone_in_any_batch_and_packed(checkpoint, dtype):
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoint, dtype)), LENGTHS)


def test_negative_control_a_batch_dependent_expert_gemm(checkpoint, monkeypatch):
    model = make_invariant(load_model(checkpoint, torch.float32))  # bf16 rounding can hide a reordered sum
    monkeypatch.setattr(experts_module, "grouped_linear", m_dependent_grouped_linear)
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size, LENGTHS), BATCHINGS[:2]) != []


def test_accuracy_against_float64_and_what_its_tolerance_catches(checkpoint):
    stock = load_model(checkpoint, torch.float32)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(model.config.vocab_size, (100,))[0][None]

    def error(change=None):
        reference = copy.deepcopy(stock).double()
        reference.set_experts_implementation("eager")  # grouped_mm has no float64
        with torch.no_grad():
            if change is not None:
                change(reference)
            return (model(ids).logits.double() - reference(ids).logits).abs().max().item()

    def no_sinks(reference):
        for layer in reference.model.layers:
            layer.self_attn.sinks.fill_(-torch.inf)

    def no_window(reference):  # a window longer than the sequence
        reference.config.sliding_window = 4096
        for layer in reference.model.layers:
            layer.self_attn.sliding_window = None

    def no_router_bias(reference):
        for layer in reference.model.layers:
            layer.mlp.router.bias.zero_()

    def other_alpha(reference):
        for layer in reference.model.layers:
            layer.mlp.experts.alpha = 1.0
    assert error() < FP32_TOLERANCE
    for change in (no_sinks, no_window, no_router_bias, other_alpha):
        assert error(change) > 100 * FP32_TOLERANCE, change.__name__


# The fast tier decodes past a window in test_sliding_window.py, with sinks in the kernel tests; the
# static sliding cache runs for Mistral and Gemma 3.
@pytest.mark.heavy
@pytest.mark.parametrize("cache", ["dynamic"])
def test_generate_past_the_window_equals_prefill_and_alone(checkpoint, cache):
    assert_generate_past_the_window_equals_prefill_and_alone(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                             cache, new_tokens=8)


@pytest.mark.heavy  # the fast tier serves gpt-oss (tests/server/test_server_state_and_sinks.py)
def test_engine_requests_equal_alone_with_prefix_hits(checkpoint):
    assert_engine_requests_equal_alone_with_prefix_hits(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                        new_tokens=4)


def test_mxfp4_experts_and_tensor_parallelism_are_refused_by_name():
    model = random_model(random_config(FAMILY, "tiny", quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(UnsupportedModelError, match="gpt_oss: make_invariant does not run MXFP4 experts"):
        make_invariant(model)
    with pytest.raises(UnsupportedModelError, match="gpt_oss: tensor parallelism does not run mixture-of-experts"):
        check_model(random_model(random_config(FAMILY, "tiny")), sharded=True)


@pytest.mark.heavy
def test_the_stock_engine_honours_sinks_and_the_window(checkpoint):
    """The engine's stock baseline (benchmarks) runs sinks and windows too: its prompt logprobs are
    within fp32 tolerance of the invariant engine's (dropping the sinks misses it by 5e-2)."""
    prompt = make_samples(512, (90,), seed=4)[0].tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    invariant = Engine(make_invariant(load_model(checkpoint, torch.float32))).generate([prompt], params)[0]
    stock = Engine(load_model(checkpoint, torch.float32), kernels="stock").generate([prompt], params)[0]
    assert max(abs(a - b) for a, b in zip(stock.prompt_logprobs, invariant.prompt_logprobs)) < 1e-4


@pytest.mark.heavy
def test_token_logprobs_equal_the_engines_and_training_is_refused_by_name(checkpoint):
    """The trainer-side ``token_logprobs`` (no grad: MoE layers do not train) equal the engine's
    sampled-token logprobs in a right-padded micro-batch, prompts past the window; a forward that
    records autograd is refused by name."""
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (66, 2, 30)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.7, seed=i, ignore_eos=True,
                             logprobs_mode="processed_logprobs") for i in range(len(prompts))]
    outs = Engine(model, max_num_seqs=2, max_num_batched_tokens=16).generate(prompts, params)
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]
    prompt_lengths = [len(o.prompt_token_ids) for o in outs]
    with torch.no_grad():
        assert trainer_logprobs(model, sequences, prompt_lengths, 3, "right", 0.7) == [o.logprobs for o in outs]
    with torch.enable_grad(), pytest.raises(UnsupportedModelError, match="MoE training is not supported"):
        trainer_logprobs(model.train(), sequences[:1], prompt_lengths[:1], 1, "left", 0.7)
