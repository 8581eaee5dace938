"""A Gated DeltaNet layer's state beside a transformers cache (``model.linear_attention``: the boundary
state and the unfinished chunk's rows) lives on that layer's own entry in the cache, not in a table
keyed by the cache: it is on ``cache.layers[i]`` of the linear-attention layers only, a copy of the
cache carries it and continues bitwise as the cache itself does. Control: a copy whose layers lost
that state continues with other logits."""
from __future__ import annotations

import copy

import pytest
import torch

import invariant_infer.model.linear_attention as linear_attention
from invariant_infer import make_invariant
from invariant_infer.model.cache_specs import linear_attention_layers
from invariant_infer.testing.random_checkpoints import random_config, random_model


@pytest.fixture(scope="module")
def prefilled():
    """(model, its cache after a 5-token prompt, the next token's ids)."""
    model = make_invariant(random_model(random_config("qwen3_5_text", "tiny"), dtype=torch.float32).eval())
    prompt = torch.tensor([[3, 17, 5, 9, 12]])
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
    return model, cache, torch.tensor([[7]])


def next_logits(model, cache, ids):
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits


def test_the_state_lives_on_the_linear_attention_layers_of_the_cache(prefilled):
    model, cache, _ = prefilled
    linear = set(linear_attention_layers(model.config))
    held = {i for i, layer in enumerate(cache.layers) if getattr(layer, linear_attention._STATE_ATTRIBUTE, None)}
    assert linear and held == linear
    assert not hasattr(linear_attention, "_STATES")  # no table keyed by the cache


def test_a_copy_of_the_cache_continues_bitwise_and_without_the_state_it_does_not(prefilled):
    model, cache, ids = prefilled
    copied, emptied = copy.deepcopy(cache), copy.deepcopy(cache)
    for layer in emptied.layers:  # the control: the transformers cache alone, our state dropped
        if hasattr(layer, linear_attention._STATE_ATTRIBUTE):
            delattr(layer, linear_attention._STATE_ATTRIBUTE)
    expected = next_logits(model, copy.deepcopy(cache), ids)
    assert torch.equal(next_logits(model, copied, ids), expected)
    assert not torch.equal(next_logits(model, emptied, ids), expected)
