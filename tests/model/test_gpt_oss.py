"""gpt-oss with bf16/fp32 experts: a sliding layer (a window of 24 keys) and a full one, attention
sinks in both, yarn RoPE on the heads' halves, fp32-scaled norms, the router with bias and the
experts with interleaved gate/up, biases and the clamped SwiGLU. Each row is bitwise itself alone
in any padded batch and packed; fp32 logits are within tolerance of stock float64 (eager experts),
which references without the sinks, without the window, without the router bias or with another
SwiGLU alpha all miss; ``generate`` past the window (dynamic and static caches) gives each row's
bits alone and each step one forward's; the engine's requests equal alone with prefix hits.
Negative control: a batch-dependent expert GEMM. MXFP4 experts and tensor parallelism are refused
by name."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers.controls import m_dependent_grouped_linear
from helpers.models import batch_mismatches, load_model, make_samples
from invariant_infer import UnsupportedModelError, make_invariant
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model import experts as experts_module
from invariant_infer.model.checks import check_model
from invariant_infer.model.padding import left_pad
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint
from test_sliding_window import assert_rows_equal_alone_in_any_batch_and_packed

FAMILY = "gpt_oss"
LENGTHS = (9, 1, 40, 5)  # past the 24-key window
FP32_TOLERANCE = 1e-5  # max |logit - stock float64's|


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("gpt_oss"), random_config(FAMILY, "tiny"), seed=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.heavy),
                                   pytest.param(torch.float32, marks=pytest.mark.heavy)])
def test_rows_equal_alone_in_any_batch_and_packed(checkpoint, dtype):
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoint, dtype)), LENGTHS)


def test_negative_control_a_batch_dependent_expert_gemm(checkpoint, monkeypatch):
    model = make_invariant(load_model(checkpoint, torch.float32))  # bf16 rounding can hide a reordered sum
    monkeypatch.setattr(experts_module, "grouped_linear", m_dependent_grouped_linear)
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size, LENGTHS)) != []


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


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.heavy)])
def test_generate_past_the_window_equals_prefill_and_alone(checkpoint, cache):
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    prompts = [s.tolist() for s in make_samples(model.config.vocab_size, (70, 5, 30))]
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                   return_dict_in_generate=True, cache_implementation=cache)
    ids, mask = left_pad(prompts)
    batch = model.generate(input_ids=ids, attention_mask=mask, **options)
    for row, prompt in enumerate(prompts):
        alone = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                               dtype=torch.long), **options)
        assert all(torch.equal(batch.scores[t][row], alone.scores[t][0]) for t in range(8))
        with torch.no_grad():  # each step's logits: one forward over its whole prefix
            full = model(alone.sequences[:, :-1]).logits[0, len(prompt) - 1:]
        assert all(torch.equal(alone.scores[t][0], full[t].float()) for t in range(8))


def test_engine_requests_equal_alone_with_prefix_hits(checkpoint):
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    shared = make_samples(model.config.vocab_size, (130,), seed=3)[0].tolist()
    prompts = [shared + [7, 8], [5, 6, 7], shared + [9], list(range(40, 110))]
    params = SamplingParams(max_tokens=5, logprobs=1, ignore_eos=True)
    alone = [Engine(model).generate([prompt], params)[0] for prompt in prompts]
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=13)
    mixed = engine.generate(prompts, params)
    assert engine.blocks.prefix_hits > 0 and all(len(o.token_ids) == 5 for o in mixed)
    assert [(o.token_ids, o.logprobs) for o in mixed] == [(o.token_ids, o.logprobs) for o in alone]


def test_mxfp4_experts_and_tensor_parallelism_are_refused_by_name():
    model = random_model(random_config(FAMILY, "tiny", quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(UnsupportedModelError, match="gpt_oss: MXFP4 experts"):
        make_invariant(model)
    with pytest.raises(UnsupportedModelError, match="gpt_oss: tensor parallelism is supported for the dense"):
        check_model(random_model(random_config(FAMILY, "tiny")), sharded=True)


def test_the_stock_engine_honours_sinks_and_the_window(checkpoint):
    """The engine's stock baseline (benchmarks) runs sinks and windows too: its prompt logprobs are
    within fp32 tolerance of the invariant engine's (dropping the sinks misses it by 5e-2)."""
    prompt = make_samples(512, (90,), seed=4)[0].tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    invariant = Engine(make_invariant(load_model(checkpoint, torch.float32))).generate([prompt], params)[0]
    stock = Engine(load_model(checkpoint, torch.float32), kernels="stock").generate([prompt], params)[0]
    assert max(abs(a - b) for a, b in zip(stock.prompt_logprobs, invariant.prompt_logprobs)) < 1e-4
