"""Bad input gets a clear error naming the problem, never a silent batch-variant fallback;
restore() gives back stock behaviour."""
import re

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2ForCausalLM

from helpers.models import load_model
from invariant_infer import (InvariantInferError, NonInvariantInputError, UnsupportedModelError, invariant,
                             is_invariant, make_invariant, restore)
from invariant_infer.model.families import FAMILIES
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config, random_model


@pytest.fixture
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, torch.bfloat16)


def test_rejects_other_model_families():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128))
    supported = re.escape(str(sorted(FAMILIES)))  # every registered family, by name
    with pytest.raises(UnsupportedModelError, match=supported + ".*model_type 'gpt2'"):
        make_invariant(gpt2)
    assert not is_invariant(gpt2)


def test_rejects_llama_pretraining_tp():
    llama = random_model(random_config("llama", pretraining_tp=2))
    with pytest.raises(UnsupportedModelError, match="pretraining_tp"):
        make_invariant(llama)


def test_rejects_mask_with_holes(model):
    make_invariant(model)
    ids = torch.randint(0, 512, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0]])
    with pytest.raises(NonInvariantInputError, match=r"rows \[1\] have holes"):
        model(input_ids=ids, attention_mask=mask)


def test_every_refusal_is_an_invariant_infer_error(model):
    """One except clause catches both refusals; each keeps its builtin base (TypeError, ValueError)."""
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128))
    with pytest.raises(InvariantInferError) as unsupported:
        make_invariant(gpt2)
    assert unsupported.type is UnsupportedModelError and isinstance(unsupported.value, TypeError)
    make_invariant(model)
    with pytest.raises(InvariantInferError) as non_invariant:
        model(input_ids=torch.randint(0, 512, (1, 3)), attention_mask=torch.tensor([[1, 0, 1]]))
    assert non_invariant.type is NonInvariantInputError and isinstance(non_invariant.value, ValueError)


def test_rejects_4d_masks(model):
    make_invariant(model)
    ids = torch.randint(0, 512, (1, 4))
    with pytest.raises(NonInvariantInputError, match="4-D"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


class LoraLikeLinear(nn.Linear):
    """Stands in for quantized / adapter layers that subclass nn.Linear."""


def test_rejects_non_plain_linear_projections(model):
    old = model.model.layers[0].self_attn.q_proj
    model.model.layers[0].self_attn.q_proj = LoraLikeLinear(old.in_features, old.out_features, dtype=old.weight.dtype)
    with pytest.raises(UnsupportedModelError, match="q_proj is .*LoraLikeLinear.*plain torch.nn.Linear"):
        make_invariant(model)


def test_rejects_non_plain_lm_head(model):
    old = model.lm_head
    model.lm_head = LoraLikeLinear(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    with pytest.raises(UnsupportedModelError, match="lm_head is .*LoraLikeLinear"):
        make_invariant(model)


def test_rejects_quantization_config(model):
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(UnsupportedModelError, match="quantized"):
        make_invariant(model)


def test_rejects_unsupported_dtype():
    with pytest.raises(UnsupportedModelError, match="float64"):
        make_invariant(random_model(qwen2_config("tiny", num_hidden_layers=1), dtype=torch.float64))


def test_rejects_unsupported_device():
    with torch.device("meta"):
        meta_model = Qwen2ForCausalLM(qwen2_config("tiny"))
    with pytest.raises(UnsupportedModelError, match="meta"):
        make_invariant(meta_model)


def test_rejects_dynamic_rope():
    dynamic = random_model(qwen2_config("tiny", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 10000.0}))
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        make_invariant(dynamic)


def test_rejects_positions_beyond_the_rope_table(model):
    make_invariant(model)
    with pytest.raises(NonInvariantInputError, match="max_position_embeddings"):
        model(input_ids=torch.tensor([[1, 2]]), position_ids=torch.tensor([[510, 512]]))
    with pytest.raises(NonInvariantInputError, match="max_position_embeddings"):  # implicit arange positions
        model(input_ids=torch.zeros(1, 513, dtype=torch.long))


def test_accepts_naive_cumsum_positions_with_negative_pads(model):
    """position_ids = mask.cumsum(-1) - 1 leaves -1 at left pads: fine, only real tokens count."""
    make_invariant(model)
    ids = torch.randint(0, 512, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        derived = model(input_ids=ids, attention_mask=mask).logits
        naive = model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1).logits
    assert torch.equal(derived[mask.bool()], naive[mask.bool()])


def test_warns_on_positions_that_disagree_with_the_mask(model):
    make_invariant(model)
    ids = torch.randint(0, 512, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.warns(UserWarning, match="cumsum"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(5)[None])


def test_base_model_takes_positional_arguments(model):
    make_invariant(model)
    ids = torch.randint(0, 512, (1, 4))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        by_name = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        by_position = model.model(ids, mask, None, None).last_hidden_state
    assert torch.equal(by_name, by_position)


def test_restore_returns_stock_behaviour(tiny_checkpoint, model):
    ids = torch.randint(0, 512, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    stock = load_model(tiny_checkpoint, torch.bfloat16)
    with torch.no_grad():
        expected = stock(input_ids=ids, attention_mask=mask).logits
        make_invariant(model)
        patched = model(input_ids=ids, attention_mask=mask).logits
        restore(model)
        restored = model(input_ids=ids, attention_mask=mask).logits
    assert not is_invariant(model)
    assert model.config._attn_implementation == stock.config._attn_implementation
    assert all("forward" not in vars(m) for m in model.modules())
    assert torch.equal(restored, expected)
    assert not torch.equal(patched, expected)  # the patch did change the arithmetic


def test_context_manager(model):
    with invariant(model) as patched:
        assert patched is model and is_invariant(model)
    assert not is_invariant(model)


def test_make_invariant_is_idempotent(model):
    assert make_invariant(make_invariant(model)) is model
    restore(model)
    assert not is_invariant(model)


def test_train_and_eval_keep_the_patch_and_its_bits(tiny_checkpoint):
    """transformers (5.25 on) re-kernelizes a model on every train()/eval() mode change, which would
    drop the patched forwards: make_invariant turns that off, and restore() turns it back on."""
    model = load_model(tiny_checkpoint, torch.float32)
    kernelized = getattr(model, "use_kernels", False)
    ids = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        make_invariant(model)
        eval_logits = model(input_ids=ids).logits
        model.train()
        train_logits = model(input_ids=ids).logits
        model.eval()
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all("forward" in vars(m) for m in norms)  # still the patch's
    assert torch.equal(train_logits, eval_logits)
    assert not getattr(model, "use_kernels", False)
    restore(model)
    assert getattr(model, "use_kernels", False) == kernelized
