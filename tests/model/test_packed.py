"""Padding-free (packed) batches, as DataCollatorWithFlattening builds them: each sequence's
logits equal, bitwise, the sequence run alone (``model(input_ids=seq[None])``), for every family."""
import pytest
import torch
from transformers import DataCollatorWithFlattening

import invariant_infer.model.attention
import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.models import DEVICES, FAMILY_NAMES, MOE_FAMILY_NAMES, family_dtype_cells, load_model
from helpers.models import make_samples
from invariant_infer import NonInvariantInputError, make_invariant
from invariant_infer.kernels import attention
from invariant_infer.kernels.configs import AttentionConfig
from invariant_infer.model.packing import resolve_packed

pytestmark = pytest.mark.file_minutes(0.7)  # measured on 2 cores: start it early

PACKED_DTYPES = [torch.bfloat16, torch.float32]
# Lengths 1 and 70 (> the CPU kernel's 64-key block and 32-query block) next to short ones.
LENGTHS = (5, 1, 12, 70, 3)


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


def collate(samples, flash_kwargs: bool) -> dict:
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": s.tolist()} for s in samples])
    del batch["labels"]
    device = samples[0].device  # as a trainer moves every tensor of the batch
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def alone(model, samples):
    return [model(input_ids=s[None]).logits[0] for s in samples]


def packed_logits(model, samples, **batch):
    """Each sample's logits, cut from the packed forward's [B, T] rows in order."""
    logits = model(**batch).logits.reshape(-1, model.config.vocab_size)
    bounds = torch.tensor([0, *[len(s) for s in samples]]).cumsum(0).tolist()
    return [logits[a:b] for a, b in zip(bounds, bounds[1:])]


def unequal(got, want) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family, dtype", family_dtype_cells(FAMILY_NAMES, PACKED_DTYPES))
def test_packed_sequences_equal_alone(family_checkpoints, family, dtype, device):
    model = make_invariant(load_model(family_checkpoints(family), dtype, device))
    samples = [s.to(device) for s in make_samples(model.config.vocab_size, LENGTHS)]
    expected = alone(model, samples)
    for flash_kwargs in (False, True):
        assert unequal(packed_logits(model, samples, **collate(samples, flash_kwargs)), expected) == [], flash_kwargs


def test_packed_accuracy_against_alone_stock(family_checkpoints):
    """The packed forward is the model, not just self-consistent: within 1e-4 of stock HF (fp32) alone."""
    for family in FAMILY_NAMES:
        stock = load_model(family_checkpoints(family), torch.float32)
        samples = make_samples(stock.config.vocab_size, (6, 2, 9))
        reference = alone(stock, samples)
        got = packed_logits(make_invariant(stock), samples, **collate(samples, True))
        for g, r in zip(got, reference):
            assert (g - r).abs().max().item() < 1e-4, family


@pytest.mark.heavy
@pytest.mark.parametrize("family", FAMILY_NAMES + MOE_FAMILY_NAMES)
def test_several_packed_rows(family_checkpoints, family):
    """[B, T] packed rows (each row a concatenation, a sequence never spanning two rows), with
    position_ids only, and with cu_seq_lens over the flattened B * T tokens as well."""
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    samples = make_samples(model.config.vocab_size, (5, 7, 4, 1, 7))  # rows: 5 + 7 and 4 + 1 + 7
    ids = torch.cat(samples).view(2, 12)
    positions = torch.cat([torch.arange(len(s)) for s in samples]).view(2, 12)
    cu = torch.tensor([0, 5, 12, 16, 17, 24], dtype=torch.int32)
    expected = alone(model, samples)
    assert unequal(packed_logits(model, samples, input_ids=ids, position_ids=positions), expected) == []
    assert unequal(packed_logits(model, samples, input_ids=ids, position_ids=positions, cu_seq_lens_q=cu,
                                 cu_seq_lens_k=cu, max_length_q=7, max_length_k=7), expected) == []
    embeds = model.get_input_embeddings()(ids).detach()
    assert unequal(packed_logits(model, samples, inputs_embeds=embeds, position_ids=positions), expected) == []


@pytest.mark.heavy
def test_many_short_sequences_and_length_one(family_checkpoints):
    model = make_invariant(load_model(family_checkpoints("qwen2"), torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    # 24 sequences of 1 to 3 tokens, then 33: about 80 packed tokens, many sequences to one KV block of 64
    samples = make_samples(model.config.vocab_size, torch.randint(1, 4, (24,), generator=g).tolist() + [33])
    expected = alone(model, samples)
    assert unequal(packed_logits(model, samples, **collate(samples, True)), expected) == []
    one = [samples[0][:1]]
    for flash_kwargs in (False, True):  # one sequence of one token: packed (with cu_seq_lens) or plain
        assert unequal(packed_logits(model, one, **collate(one, flash_kwargs)), alone(model, one)) == []


def test_cu_seq_lens_without_position_ids(family_checkpoints):
    """cu_seq_lens alone (DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True))
    give the positions: 0, 1, ... within each sequence."""
    model = make_invariant(load_model(family_checkpoints("llama"), torch.float32))
    samples = make_samples(model.config.vocab_size, (4, 9, 2))
    batch = DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True)(
        [{"input_ids": s.tolist()} for s in samples])
    del batch["labels"]
    assert "position_ids" not in batch
    assert unequal(packed_logits(model, samples, **batch), alone(model, samples)) == []


def test_trl_padding_free_collator(family_checkpoints):
    """TRL's padding-free collator: cu_seq_lens, seq_idx, and padding to a multiple as position-0
    tokens (each pad its own one-token sequence)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model = make_invariant(load_model(family_checkpoints("qwen3"), torch.bfloat16))
    samples = make_samples(model.config.vocab_size, (6, 3, 10))
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=8)(
        [{"input_ids": s.tolist()} for s in samples])
    del batch["labels"]
    assert batch["input_ids"].shape == (1, 24) and batch["cu_seq_lens_q"].numel() == 9  # 3 + 5 pads
    assert unequal(packed_logits(model, samples, **batch), alone(model, samples)) == []


@pytest.mark.fast_cells(1)
def test_negative_control_m_dependent_matmul_is_caught(family_checkpoint, monkeypatch):
    """The comparison fails when the linear picks its tiles by M (a packed row has more tokens than
    its short sequences alone)."""
    model = make_invariant(load_model(family_checkpoint, torch.float32))
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    samples = make_samples(model.config.vocab_size, (1, 3, 9))
    assert unequal(packed_logits(model, samples, **collate(samples, False)), alone(model, samples)) != []


def width_dependent_attend(query, key, value, kv_start, kv_end, q_start, scale, window=0, sinks=None):
    """Negative control: a KV block picked by the batch's key width (16 when wider than 32 keys)."""
    block_n = 16 if key.shape[2] > 32 else 64
    return attention(query, key, value, kv_start, kv_end, q_start, scale, config=AttentionConfig(32, block_n),
                     window=window, sinks=sinks)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_negative_control_width_dependent_attention_is_caught(family_checkpoints, dtype, monkeypatch):
    """The comparison fails when attention's KV block depends on the batch: the 20-token sequence
    alone reduces its keys in one block, packed next to a 40-token one in two."""
    model = make_invariant(load_model(family_checkpoints("qwen2"), dtype))
    monkeypatch.setattr(invariant_infer.model.attention, "attend", width_dependent_attend)
    samples = make_samples(model.config.vocab_size, (20, 40))
    assert 0 in unequal(packed_logits(model, samples, **collate(samples, True)), alone(model, samples))


# ---- refusals ------------------------------------------------------------------------------------

@pytest.fixture
def model(family_checkpoints):
    return make_invariant(load_model(family_checkpoints("qwen2"), torch.float32))


def test_refuses_packed_rows_with_an_attention_mask(model):
    ids = torch.randint(0, 512, (2, 6))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 0]])
    for mask in (torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]), torch.ones(2, 6, dtype=torch.long)):
        with pytest.raises(NonInvariantInputError, match="packed rows take no attention_mask"):
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(NonInvariantInputError, match="take no attention_mask"):
        model(input_ids=ids[:1], attention_mask=torch.ones(1, 6, dtype=torch.long), cu_seq_lens_q=cu,
              cu_seq_lens_k=cu)


@pytest.mark.parametrize("positions", [[[1, 2, 0, 1]], [[0, 1, 3, 4]], [[0, 1, 0, 2]], [[0, 1, 2, 0], [1, 0, 1, 2]]])
def test_refuses_positions_that_are_not_packed_sequences(model, positions):
    """Rows must start at 0; inside a row a position restarts at 0 or follows its predecessor by 1."""
    positions = torch.tensor(positions)
    with pytest.raises(NonInvariantInputError, match="must start at 0 in every row"):
        model(input_ids=torch.randint(0, 512, positions.shape), position_ids=positions)


def test_refuses_cu_seq_lens_that_disagree(model):
    ids = torch.randint(0, 512, (1, 6))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    good = torch.tensor([0, 3, 6], dtype=torch.int32)
    bad = {"other boundaries": dict(cu_seq_lens_q=torch.tensor([0, 2, 6]), cu_seq_lens_k=torch.tensor([0, 2, 6])),
           "q differs from k": dict(cu_seq_lens_q=good, cu_seq_lens_k=torch.tensor([0, 2, 6])),
           "too short total": dict(cu_seq_lens_q=torch.tensor([0, 3]), cu_seq_lens_k=torch.tensor([0, 3])),
           "extra boundary": dict(cu_seq_lens_q=torch.tensor([0, 3, 3, 6]), cu_seq_lens_k=torch.tensor([0, 3, 3, 6]))}
    for name, kwargs in bad.items():
        with pytest.raises(NonInvariantInputError, match="disagree with position_ids"):
            model(input_ids=ids, position_ids=positions, **kwargs)
    with pytest.raises(NonInvariantInputError, match="max_length_q=4"):
        model(input_ids=ids, position_ids=positions, cu_seq_lens_q=good, cu_seq_lens_k=good, max_length_q=4,
              max_length_k=3)
    with pytest.raises(NonInvariantInputError, match="must be equal"):
        model(input_ids=ids, position_ids=positions, cu_seq_lens_q=good, cu_seq_lens_k=torch.tensor([0, 6]))
    with pytest.raises(NonInvariantInputError, match="need cu_seq_lens"):
        model(input_ids=ids, position_ids=positions, max_length_q=3)


def test_refuses_packed_rows_after_a_cache(model):
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 512, (1, 4)), use_cache=True).past_key_values
        with pytest.raises(NonInvariantInputError, match="cannot continue a KV cache"):
            model(input_ids=torch.randint(0, 512, (1, 4)), position_ids=torch.tensor([[0, 1, 0, 1]]),
                  cache=cache)


def test_plain_position_ids_are_not_packed():
    """One sequence a row, positions increasing by 1 from any start: no regrouping, positions as given."""
    positions, layout = resolve_packed(torch.tensor([[4, 5, 6]]), {}, batch=2, length=3, cache_length=0,
                                       max_positions=16, device=torch.device("cpu"))
    assert layout is None and positions.tolist() == [[4, 5, 6]]


# ---- the regrouping itself -----------------------------------------------------------------------

def test_regroup_is_an_exact_permutation_both_ways():
    """regroup / ungroup copy values (padding slots are 0) and their gradients are copies too: no
    addition touches a value, so even -0.0 survives."""
    positions = torch.tensor([[0, 1, 2, 0, 0, 1]])
    _, layout = resolve_packed(positions, {}, batch=1, length=6, cache_length=0, max_positions=16,
                               device=torch.device("cpu"))
    assert (layout.sequences, layout.width, layout.lengths.tolist()) == (3, 3, [3, 1, 2])
    assert layout.bounds()[:, :, 0, 0].tolist() == [[0, 0, 0], [3, 1, 2], [0, 0, 0]]
    torch.set_grad_enabled(True)  # inside this file's no_grad fixture
    x = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    x[0, 0, 4, 0] = -0.0
    x.requires_grad_(True)
    rows = layout.regroup(x)  # [S, H, width, D]
    assert rows.shape == (3, 2, 3, 4)
    assert torch.equal(rows[0, :, :3], x[0, :, 0:3]) and torch.equal(rows[2, :, :2], x[0, :, 4:6])
    assert torch.equal(rows[1, :, 0], x[0, :, 3]) and not rows[1, :, 1:].any() and not rows[2, :, 2].any()
    out = layout.ungroup(rows.transpose(1, 2))  # back to [B, T, H, D]
    assert torch.equal(out, x.transpose(1, 2))
    grad = torch.randn_like(out)
    grad[0, 4, 0, 0] = -0.0
    out.backward(grad)
    assert torch.equal(x.grad, grad.transpose(1, 2)) and torch.signbit(x.grad[0, 0, 4, 0])
    assert torch.autograd.gradcheck(lambda t: layout.ungroup(layout.regroup(t).transpose(1, 2) * 2), (x,))
