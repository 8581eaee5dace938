"""PEFT LoRA models on the invariant kernels (``invariant_infer.model.lora``): bitwise batch invariance
of the unmerged adapter's logits, accuracy against float64, training gradients, the refusals, and a
negative control (a LoRA shrink whose K split depends on the rows per adapter, as vLLM's split_k)."""
import copy

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from peft.utils import ModulesToSaveWrapper

from helpers.models import BATCHINGS, batch_mismatches, make_samples
from invariant_infer import make_invariant, pad_sequences, restore, score_sequences
from invariant_infer.errors import NonInvariantInputError, UnsupportedModelError
from invariant_infer.kernels import LinearConfig, linear_config
from invariant_infer.model import lora as lora_module
from invariant_infer.model.patch import is_invariant
from invariant_infer.testing.random_checkpoints import qwen2_config, random_model
from invariant_infer.training import token_logprobs

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Two adapters of different ranks: every projection with rsLoRA and a trained lm_head copy, and two.
ADAPTERS = {
    "wide": LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_PROJECTIONS, lora_dropout=0.0,
                       modules_to_save=["lm_head"], init_lora_weights=False),
    "narrow": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], lora_dropout=0.0,
                         init_lora_weights=False),
}
BATCH_CHECKS = [BATCHINGS[1], BATCHINGS[2]]  # left + extra padding, right padding
# Max |logit - float64 reference|, stated per dtype (logits here are O(1)); ours must also stay within
# twice stock PEFT's own error (plus one bf16 step of the logits' scale).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2.5e-2}


def peft_model(dtype, adapters=("wide", "narrow"), seed=0):
    """A one-layer random Qwen2 with the named adapters (random nonzero A and B), the first active."""
    torch.manual_seed(seed)
    base = random_model(qwen2_config("tiny", num_hidden_layers=1), seed=seed, dtype=dtype)
    model = get_peft_model(base, copy.deepcopy(ADAPTERS[adapters[0]]), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, copy.deepcopy(ADAPTERS[name]))
    with torch.no_grad():  # the lm_head copy differs from the base head, so using it shows
        for module in model.modules():
            if isinstance(module, ModulesToSaveWrapper):
                for copy_ in module.modules_to_save.values():
                    copy_.weight.mul_(1.5)
    return model.eval()


@pytest.fixture(scope="module")
def stock_models():
    return {dtype: peft_model(dtype) for dtype in (torch.bfloat16, torch.float32)}


def invariant_copy(model, adapter):
    patched = make_invariant(copy.deepcopy(model))
    patched.set_adapter(adapter)
    return patched


@pytest.mark.parametrize(("dtype", "adapter"), [(torch.bfloat16, "wide"), (torch.float32, "narrow")], ids=str)
def test_peft_logits_bitwise_batch_invariant(stock_models, dtype, adapter):
    model = invariant_copy(stock_models[dtype], adapter)
    assert is_invariant(model)
    samples = make_samples(model.config.vocab_size)
    assert batch_mismatches(model, samples, BATCH_CHECKS) == []


def test_negative_control_rows_dependent_shrink_split_is_caught(stock_models, monkeypatch):
    """vLLM's pattern (split_k = 64 if batch < 128 else 8), scaled to these widths: the shrink's K is
    cut into 4 chunks when fewer than 16 rows share the adapter, else summed in one. The same check
    as above must catch it."""
    model = invariant_copy(stock_models[torch.float32], "narrow")
    samples = make_samples(model.config.vocab_size)

    def rows_dependent(device_type, dtype, rows, rank, k):
        base = linear_config(device_type, dtype, rank, k)
        return LinearConfig(base.block_m, base.block_n, 16, k_chunks=4 if rows < 16 else 1)
    monkeypatch.setattr(lora_module, "shrink_config", rows_dependent)
    assert batch_mismatches(model, samples, BATCH_CHECKS[:1]), "the rows-dependent split went unnoticed"


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.double()


@pytest.mark.parametrize(("dtype", "adapter"), [(torch.bfloat16, "wide"), (torch.float32, "narrow")], ids=str)
def test_unmerged_forward_accuracy_stock_vs_ours_vs_float64(stock_models, dtype, adapter):
    stock = copy.deepcopy(stock_models[dtype])
    stock.set_adapter(adapter)
    samples = make_samples(stock.config.vocab_size, lengths=(9, 4))
    ids, mask = pad_sequences(samples, side="left")
    real = mask.bool()
    reference = copy.deepcopy(stock).double()
    want = _logits(reference, ids, mask)[real]
    stock_error = (_logits(stock, ids, mask)[real] - want).abs().max().item()
    ours_error = (_logits(invariant_copy(stock, adapter), ids, mask)[real] - want).abs().max().item()
    with reference.disable_adapter():  # the adapter changes the logits by far more than the tolerance
        assert (_logits(reference, ids, mask)[real] - want).abs().max().item() > 5 * TOLERANCE[dtype]
    assert ours_error <= TOLERANCE[dtype], ours_error
    assert ours_error <= 2 * stock_error + (1e-6 if dtype == torch.float32 else 8e-3), (ours_error, stock_error)


def test_merge_and_unload_runs_invariant_with_other_bits(stock_models):
    """Merging folds scaling * B @ A into each base weight, rounded to bf16: still invariant, other bits."""
    model = invariant_copy(stock_models[torch.bfloat16], "narrow")
    samples = make_samples(model.config.vocab_size)
    ids, mask = pad_sequences(samples, side="left")
    unmerged = _logits(model, ids, mask)
    merged = model.merge_and_unload()
    assert is_invariant(merged)
    assert batch_mismatches(merged, samples, BATCH_CHECKS[:1]) == []
    merged_logits = _logits(merged, ids, mask)
    real = mask.bool()
    assert not torch.equal(merged_logits[real], unmerged[real])
    assert (merged_logits[real] - unmerged[real]).abs().max().item() < TOLERANCE[torch.bfloat16]


def test_restore_gives_stock_peft_forward_back(stock_models):
    stock = stock_models[torch.float32]
    stock.set_adapter("narrow")
    model = invariant_copy(stock, "narrow")
    ids = make_samples(stock.config.vocab_size, lengths=(6,))[0][None]
    mask = torch.ones_like(ids)
    assert restore(model) is model and not is_invariant(model)
    assert torch.equal(_logits(model, ids, mask), _logits(stock, ids, mask))
    stock.set_adapter("wide")


def test_lora_added_after_the_patch_is_patched_by_make_invariant_again():
    def lora_model(base):
        torch.manual_seed(5)  # the same random A and B
        return get_peft_model(base, copy.deepcopy(ADAPTERS["narrow"]))
    config = qwen2_config("tiny", num_hidden_layers=1)
    model = lora_model(make_invariant(random_model(config, seed=0)))
    assert make_invariant(model) is model
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    assert layer.forward.__func__ is lora_module.peft_lora_forward
    fresh = make_invariant(lora_model(random_model(config, seed=0)))
    ids = make_samples(config.vocab_size, lengths=(6,))[0][None]
    assert torch.equal(_logits(model, ids, torch.ones_like(ids)), _logits(fresh, ids, torch.ones_like(ids)))


def test_token_logprobs_equal_scoring_bitwise(stock_models):
    model = invariant_copy(stock_models[torch.bfloat16], "wide")
    samples = make_samples(model.config.vocab_size, lengths=(9, 4, 6))
    ids, mask = pad_sequences(samples, side="right")
    with torch.no_grad():
        logps = token_logprobs(model, ids, mask)
    scored = score_sequences(model, [s.tolist() for s in samples])
    for row, (sample, result) in enumerate(zip(samples, scored)):
        assert torch.equal(logps[row, :len(sample) - 1], result.token_logprobs)


# ---- training ---------------------------------------------------------------------------------------

def _embeds_grads(model, samples, members, cotangents):
    """(input-embedding grads per member, {LoRA parameter: grad}) of one left-padded batch."""
    model.zero_grad(set_to_none=True)
    ids, mask = pad_sequences([samples[i] for i in members], side="left")
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, attention_mask=mask).logits
    loss = sum((logits[row][mask[row].bool()] * cotangents[i]).sum() for row, i in enumerate(members))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return [embeds.grad[row][mask[row].bool()] for row in range(len(members))], grads


def test_train_mode_gradients_deterministic_and_input_grads_batch_invariant():
    model = make_invariant(peft_model(torch.float32, adapters=("narrow",))).train()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)  # the base is frozen
    samples = make_samples(model.config.vocab_size, lengths=(5, 3))
    cotangents = [torch.randn(len(s), model.config.vocab_size) for s in samples]
    alone = [_embeds_grads(model, samples, (i,), cotangents)[0][0] for i in range(len(samples))]
    batched, grads = _embeds_grads(model, samples, (0, 1), cotangents)
    for i in range(len(samples)):
        assert torch.equal(batched[i], alone[i])
    again = _embeds_grads(model, samples, (0, 1), cotangents)[1]
    assert grads.keys() == trainable and all(torch.equal(grads[n], again[n]) for n in grads)
    assert all(grads[n].abs().sum() > 0 for n in grads)
    assert all(p.grad is None for name, p in model.named_parameters() if name not in trainable)


# ---- refusals ---------------------------------------------------------------------------------------

def test_lora_dropout_refused_in_train_mode_only():
    base = random_model(qwen2_config("tiny", num_hidden_layers=1))
    config = LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.1, init_lora_weights=False)
    model = make_invariant(get_peft_model(base, config))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model.eval()(input_ids=ids)  # eval: dropout is the identity
    with pytest.raises(NonInvariantInputError, match="lora_dropout=0.1"):
        model.train()(input_ids=ids)


@pytest.mark.parametrize(("config", "match"), [
    (LoraConfig(r=2, target_modules=["q_proj"], use_dora=True), "DoRA"),
    (LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    (IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), "IA3"),
    (LoraConfig(r=2, target_modules=["lm_head"]), "lm_head"),
], ids=["dora", "lora-bias", "ia3", "lm-head"])
def test_refused_by_name(config, match):
    model = get_peft_model(random_model(qwen2_config("tiny", num_hidden_layers=1)), config)
    with pytest.raises(UnsupportedModelError, match=match):
        make_invariant(model)
    assert not is_invariant(model)
