"""Model level, for every family: every sample's logits alone equal, bitwise, its rows in any batch."""
import pytest
import torch

import invariant_infer.patch
from helpers import DEVICES, DTYPES, FAMILY_NAMES, load_model
from helpers import BATCHINGS, Batching, batch_mismatches, make_samples
from invariant_infer import make_invariant, pad_sequences
from invariant_infer.random_checkpoints import random_config, save_random_checkpoint
from helpers import m_dependent_linear


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_alone_equal_logits_in_any_batch(family_checkpoint, dtype, device):
    model = make_invariant(load_model(family_checkpoint, dtype, device))
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

    for family in FAMILY_NAMES:
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
@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_embeds_script(family_checkpoint, dtype, device):
    batch0, single0 = inputs_embeds_script(make_invariant(load_model(family_checkpoint, dtype, device)))
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


@pytest.mark.slow
def test_negative_control_stock_hf_at_real_widths_is_not_invariant(real_width_checkpoint):
    stock = load_model(real_width_checkpoint, torch.bfloat16)
    samples = make_samples(stock.config.vocab_size, REAL_WIDTH_SAMPLE_LENGTHS)
    mismatches = batch_mismatches(stock, samples, STOCK_BATCHINGS)
    assert mismatches, "stock HF was expected to differ between batch and alone at real widths"
    assert max(diff for _, _, diff in mismatches) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_invariant_at_real_widths(real_width_checkpoint, device):
    model = make_invariant(load_model(real_width_checkpoint, torch.bfloat16, device))
    samples = make_samples(model.config.vocab_size, REAL_WIDTH_SAMPLE_LENGTHS)
    assert batch_mismatches(model, samples, REAL_WIDTH_BATCHINGS) == []
    batch0, single0 = inputs_embeds_script(model)
    assert torch.equal(batch0, single0)


@pytest.mark.slow
@pytest.mark.parametrize("family, preset", [("qwen3", "qwen3-0.6b"), ("llama", "llama-3.2-1b"),
                                            ("mistral", "mistral-7b-v0.3")])
def test_negative_control_stock_hf_at_each_family_real_widths(tmp_path, family, preset):
    """Stock HF at each family's real widths (one layer, small vocab) differs between batch and alone."""
    config = random_config(family, preset, num_hidden_layers=1, vocab_size=2048, max_position_embeddings=1024)
    stock = load_model(save_random_checkpoint(tmp_path / family, config, seed=3), torch.bfloat16)
    samples = make_samples(stock.config.vocab_size, REAL_WIDTH_SAMPLE_LENGTHS)
    assert batch_mismatches(stock, samples, STOCK_BATCHINGS), f"stock {family} was expected to differ"


def test_negative_control_m_dependent_matmul_is_caught(family_checkpoint, monkeypatch):
    """The same test fails when the linear picks its tiles by M."""
    model = make_invariant(load_model(family_checkpoint, torch.float32))
    monkeypatch.setattr(invariant_infer.patch, "linear", m_dependent_linear)
    samples = make_samples(model.config.vocab_size)
    assert batch_mismatches(model, samples, BATCHINGS[:2]) != []
