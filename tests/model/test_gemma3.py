"""Gemma 3's text model (``gemma3_text``): sliding-window layers (a window of 24 keys) beside global
ones with their own RoPE base, (1 + w) RMSNorms in fp32, the scaled embeddings, ``query_pre_attn_scalar``
and the gelu_tanh MLP. Each row is bitwise itself alone in any padded batch and packed; fp32 logits
are within tolerance of stock float64, which references without the window, without the norms'
offset or without the embedding scale all miss; ``generate`` past the window with the static sliding
cache (the dynamic one: tests/model/test_sliding_window.py) gives each row's bits alone and each step
one forward's; the engine's requests
equal alone with prefix hits. Logit softcapping and bidirectional attention are refused by name."""
from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from helpers.models import load_model, make_samples
from invariant_infer import UnsupportedModelError, make_invariant
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint
from test_sliding_window import (assert_engine_requests_equal_alone_with_prefix_hits,
                                 assert_generate_past_the_window_equals_prefill_and_alone,
                                 assert_rows_equal_alone_in_any_batch_and_packed)

FAMILY = "gemma3_text"
LENGTHS = (9, 1, 40, 5)  # past the 24-key window
FP32_TOLERANCE = 1e-5  # max |logit - stock float64's|; measured 5.3e-7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("gemma3"), random_config(FAMILY, "tiny"), seed=1)


def test_rows_equal_alone_in_any_batch_and_packed(checkpoint):
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoint, torch.bfloat16)), LENGTHS)


def _without_norm_offset(norm):
    norm.forward = types.MethodType(lambda self, x: (self._norm(x.float()) * self.weight.float()).type_as(x), norm)


def test_accuracy_against_float64_and_what_its_tolerance_catches(checkpoint):
    stock = load_model(checkpoint, torch.float32)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(model.config.vocab_size, (100,))[0][None]

    def error(change=None):
        reference = copy.deepcopy(stock).double()
        if change is not None:
            change(reference)
        with torch.no_grad():
            return (model(ids).logits.double() - reference(ids).logits).abs().max().item()

    def no_window(reference):  # a window longer than the sequence
        reference.config.sliding_window = 4096
        for layer in reference.model.layers:
            layer.self_attn.sliding_window = None

    def no_norm_offset(reference):
        for module in reference.modules():
            if isinstance(module, Gemma3RMSNorm):
                _without_norm_offset(module)

    def no_embedding_scale(reference):
        reference.model.embed_tokens.embed_scale.fill_(1.0)
    assert error() < FP32_TOLERANCE
    for change in (no_window, no_norm_offset, no_embedding_scale):
        assert error(change) > 100 * FP32_TOLERANCE, change.__name__


@pytest.mark.heavy  # the fast tier decodes past a window (dynamic cache) in tests/model/test_sliding_window.py
@pytest.mark.parametrize("cache", ["static"])
def test_generate_past_the_window_equals_prefill_and_alone(checkpoint, cache):
    assert_generate_past_the_window_equals_prefill_and_alone(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                             cache, new_tokens=8)


@pytest.mark.heavy
def test_engine_requests_equal_alone_with_prefix_hits(checkpoint):
    assert_engine_requests_equal_alone_with_prefix_hits(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                        new_tokens=4, alone_prompt_logprobs=True)


@pytest.mark.parametrize("field, value, match", [("final_logit_softcapping", 30.0, "softcapping"),
                                                 ("attn_logit_softcapping", 50.0, "softcapping"),
                                                 ("use_bidirectional_attention", True, "causal")])
def test_refusals_name_what_is_not_supported(field, value, match):
    model = random_model(random_config(FAMILY, "tiny", **{field: value}))
    with pytest.raises(UnsupportedModelError, match=f"gemma3_text: .*{field}.*{match}"):
        make_invariant(model)

