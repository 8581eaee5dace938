"""Model level, for every family: every sample's logits alone equal, bitwise, its rows in any batch."""
from dataclasses import replace

import pytest
import torch

import invariant_infer.model.layer_forwards
from helpers.models import (BATCHINGS, DEVICES, DTYPES, FAMILY_NAMES, MOE_FAMILY_NAMES, Batching, batch_mismatches,
                            load_model)
from helpers.models import family_dtype_cells, make_samples
from helpers.controls import m_dependent_linear
from invariant_infer import make_invariant, pad_sequences
from invariant_infer.testing.drift import logits_alone, logits_in_batch
from invariant_infer.kernels import linear, linear_config
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

pytestmark = pytest.mark.file_minutes(1)  # measured on 2 cores: start it early


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family, dtype", family_dtype_cells(FAMILY_NAMES, DTYPES))
def test_logits_alone_equal_logits_in_any_batch(family_checkpoints, family, dtype, device):
    model = make_invariant(load_model(family_checkpoints(family), dtype, device))
    samples = make_samples(model.config.vocab_size)
    assert batch_mismatches(model, samples) == []


@pytest.mark.parametrize("device", DEVICES)
def test_tied_lm_head_model(tied_checkpoint, device):
    model = make_invariant(load_model(tied_checkpoint, torch.bfloat16, device))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    samples = make_samples(model.config.vocab_size, lengths=(6, 11, 2))
    assert batch_mismatches(model, samples, [Batching((0, 1, 2)), Batching((2, 1), left_pad=False)]) == []


def test_base_model_without_lm_head(family_checkpoints):
    """AutoModel (the base model, no lm_head) is patched too: hidden states are batch-invariant."""
    from transformers import AutoModel

    for family in FAMILY_NAMES + MOE_FAMILY_NAMES:
        base = make_invariant(AutoModel.from_pretrained(family_checkpoints(family), dtype=torch.bfloat16).eval())
        samples = make_samples(base.config.vocab_size, lengths=(7, 3))
        ids, mask = pad_sequences(samples, side="left")
        with torch.no_grad():
            batch = base(input_ids=ids, attention_mask=mask).last_hidden_state
            alone = base(input_ids=samples[1][None]).last_hidden_state[0]
        assert torch.equal(batch[1, -3:], alone), family


def inputs_embeds_script(model):
    """The classic report: three one-token texts, inputs_embeds, arange position_ids, logits[0]."""
    device = next(model.parameters()).device
    ids = torch.tensor([[11], [42], [7]], device=device)
    embeds = model.get_input_embeddings()(ids)
    position_ids = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    with torch.no_grad():
        batch = model(inputs_embeds=embeds, position_ids=position_ids).logits
        single = model(inputs_embeds=embeds[:1], position_ids=position_ids).logits
    return batch[0], single[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family, dtype", family_dtype_cells(FAMILY_NAMES, DTYPES))
def test_inputs_embeds_script(family_checkpoints, family, dtype, device):
    batch0, single0 = inputs_embeds_script(make_invariant(load_model(family_checkpoints(family), dtype, device)))
    assert torch.equal(batch0, single0)


@pytest.fixture(scope="module")
def real_width_checkpoint(tmp_path_factory):
    """Qwen2.5-1.5B's layer widths (hidden 1536, MLP 8960, 12 heads of 128, 2 KV heads, q/k/v bias),
    one layer and a small vocab so CPU can afford it."""
    config = random_config("qwen2", "qwen2.5-1.5b", num_hidden_layers=1, vocab_size=2048, max_position_embeddings=1024)
    return save_random_checkpoint(tmp_path_factory.mktemp("qwen25-widths"), config, seed=3)


REAL_WIDTH_SAMPLE_LENGTHS = (1, 33, 7, 20)
REAL_WIDTH_BATCHINGS = [Batching((0, 1, 2, 3)), Batching((3, 1, 0), left_pad=False, extra_pad=2)]
# Stock HF gets the mask's positions too, so that what differs is reduction order alone.
STOCK_BATCHINGS = [Batching(b.members, b.left_pad, b.extra_pad, pass_positions=True) for b in REAL_WIDTH_BATCHINGS]


def halved_block_k_at_small_m(x, weight, bias=None, config=None):
    """Negative control at real widths: half the fixed BLOCK_K when M <= 4 (a deliberately
    M-dependent config, cheaper in the interpreter than m_dependent_linear's BLOCK_K of 16)."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    base = config or linear_config(x.device.type, x.dtype, *weight.shape)
    block_k = max(16, base.block_k // 2) if m <= 4 else base.block_k
    return linear(x, weight, bias, config=replace(base, block_k=block_k))


@pytest.mark.heavy
@pytest.mark.slow
def test_negative_control_m_dependent_config_at_real_widths_is_caught(real_width_checkpoint, monkeypatch):
    """The real-width comparison fails when the config depends on M: the 1-token sample alone
    runs at M = 1, in the batch at M > 4."""
    model = make_invariant(load_model(real_width_checkpoint, torch.float32))
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", halved_block_k_at_small_m)
    one_token, other = make_samples(model.config.vocab_size, (1, 4))
    assert not torch.equal(logits_in_batch(model, [one_token, other])[0], logits_alone(model, one_token))


@pytest.mark.slow
def test_second_control_stock_hf_at_real_widths_is_not_invariant(real_width_checkpoint):
    """Stock HF at Qwen2.5-1.5B's widths differs between batch and alone (through this machine's
    BLAS, so a second control only; the one above fails on any machine)."""
    stock = load_model(real_width_checkpoint, torch.bfloat16)
    samples = make_samples(stock.config.vocab_size, REAL_WIDTH_SAMPLE_LENGTHS)
    mismatches = batch_mismatches(stock, samples, STOCK_BATCHINGS)
    assert mismatches, "stock HF was expected to differ between batch and alone at real widths"
    assert max(diff for _, _, diff in mismatches) > 1e-3


@pytest.mark.heavy  # about a minute through the interpreter; the controls at these widths stay fast
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_invariant_at_real_widths(real_width_checkpoint, device):
    model = make_invariant(load_model(real_width_checkpoint, torch.bfloat16, device))
    samples = make_samples(model.config.vocab_size, REAL_WIDTH_SAMPLE_LENGTHS)
    assert batch_mismatches(model, samples, REAL_WIDTH_BATCHINGS) == []
    batch0, single0 = inputs_embeds_script(model)
    assert torch.equal(batch0, single0)


@pytest.mark.fast_cells(1)
def test_negative_control_m_dependent_matmul_is_caught(family_checkpoint, monkeypatch):
    """The same test fails when the linear picks its tiles by M."""
    model = make_invariant(load_model(family_checkpoint, torch.float32))
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    samples = make_samples(model.config.vocab_size)
    assert batch_mismatches(model, samples, BATCHINGS[:2]) != []
