"""Training on the invariant kernels, model level: a grad-enabled train-mode forward gives inference's
bits, gradients are batch-invariant per sample (input gradients) and deterministic (parameter
gradients), and the usual training machinery works unchanged."""
import sys

import pytest
import torch

from helpers.models import FAMILY_NAMES, load_model, make_samples
from invariant_infer import make_invariant, pad_sequences, restore
from invariant_infer.errors import NonInvariantInputError
from invariant_infer.kernels import LinearConfig, linear, linear_config
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

pytestmark = pytest.mark.file_minutes(1.4)  # measured on 2 cores: start it early

# The module, not the function of the same name that the package exports.
linear_autograd_mod = sys.modules["invariant_infer.kernels.linear_autograd"]
TRAIN_DTYPES = [torch.bfloat16, torch.float32]
LAYOUTS = [("left", 0), ("right", 3)]  # (padding side, padding beyond the longest sample)


def trainable(path, dtype):
    return make_invariant(load_model(path, dtype)).train()


def alone_logits(model, sample):
    """Inference: eval mode, no grad (the model is left in eval mode)."""
    with torch.no_grad():
        return model.eval()(input_ids=sample[None]).logits[0]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", TRAIN_DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_train_mode_forward_with_grad_gives_inference_bits(family_checkpoints, family, dtype):
    model = trainable(family_checkpoints(family), dtype)
    samples = make_samples(model.config.vocab_size, lengths=(9, 3, 14))
    alone = [alone_logits(model, s) for s in samples]
    model.train()
    for side, extra in LAYOUTS:
        ids, mask = pad_sequences(samples, side=side, width=14 + extra)
        logits = model(input_ids=ids, attention_mask=mask).logits
        assert logits.requires_grad
        for row, sample in enumerate(samples):
            real = mask[row].bool()
            assert torch.equal(logits[row][real], alone[row]), (family, side, row)


def embeds_grad(model, samples, members, side, extra, cotangents):
    """d(sum over real rows of logits * cotangent) / d inputs_embeds, per member, from one padded batch."""
    width = max(len(samples[i]) for i in members) + extra
    ids, mask = pad_sequences([samples[i] for i in members], side=side, width=width, device=model.device)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, attention_mask=mask).logits
    loss = 0
    for row, i in enumerate(members):
        real = mask[row].bool()
        loss = loss + (logits[row][real].float() * cotangents[i]).sum()
    loss.backward()
    return [embeds.grad[row][mask[row].bool()] for row in range(len(members))]


def input_gradient_mismatches(model, samples):
    g = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(len(s), model.config.vocab_size, generator=g).to(model.device) for s in samples]
    alone = [embeds_grad(model, samples, [i], "left", 0, cotangents)[0] for i in range(len(samples))]
    found = []
    for members, side, extra in [((0, 1, 2), "left", 0), ((2, 0), "right", 4), ((1, 2, 0), "left", 2)]:
        for i, grad in zip(members, embeds_grad(model, samples, members, side, extra, cotangents)):
            if not torch.equal(grad, alone[i]):
                found.append((members, side, i))
    return found


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("family, dtype", [(f, torch.bfloat16) for f in FAMILY_NAMES] + [("qwen2", torch.float32)])
def test_a_samples_input_gradient_is_the_same_in_any_batch(family_checkpoints, family, dtype):
    """Every backward kernel is row-invariant, attention's dK/dV included (a sample's keys get
    gradient only from its own queries, summed in blocks aligned to its first token)."""
    model = trainable(family_checkpoints(family), dtype)
    samples = make_samples(model.config.vocab_size, lengths=(7, 2, 11))
    assert input_gradient_mismatches(model, samples) == []


def test_negative_control_m_dependent_input_gradient_is_caught(tiny_checkpoint, monkeypatch):
    def m_dependent_grad_input(grad_y2, weight, config=None):
        base = linear_config(grad_y2.device.type, grad_y2.dtype, weight.shape[1], weight.shape[0])
        cfg = LinearConfig(base.block_m, base.block_n, 16 if grad_y2.shape[0] <= 12 else 64)
        return linear(grad_y2, weight.t(), config=cfg)
    monkeypatch.setattr(linear_autograd_mod, "grad_input", m_dependent_grad_input)
    model = trainable(tiny_checkpoint, torch.float32)  # fp32, where a reordered sum shows
    samples = make_samples(model.config.vocab_size, lengths=(7, 2, 11))
    assert input_gradient_mismatches(model, samples) != []


def parameter_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                      reduction="none").mul(mask[:, 1:].flatten()).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_same_micro_batch_gives_the_same_parameter_gradients_twice(family_checkpoints, family):
    model = trainable(family_checkpoints(family), torch.bfloat16)
    ids, mask = pad_sequences(make_samples(model.config.vocab_size, lengths=(9, 4, 12)), side="left")
    first, second = parameter_grads(model, ids, mask), parameter_grads(model, ids, mask)
    assert first.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(first[n], second[n]) for n in first)


# fp32 model against the stock model in float64: max |error| / max |reference| per parameter.
FP32_GRAD_TOLERANCE = 1e-4


def test_parameter_gradients_match_float64(tiny_checkpoint):
    model = trainable(tiny_checkpoint, torch.float32)
    ids, mask = pad_sequences(make_samples(model.config.vocab_size, lengths=(9, 4, 12)), side="right")
    got = parameter_grads(model, ids, mask)
    reference = restore(load_model(tiny_checkpoint, torch.float64)).train()
    want = parameter_grads(reference, ids, mask)
    for name, grad in got.items():
        err = ((grad.double() - want[name]).abs().max() / want[name].abs().max()).item()
        assert err < FP32_GRAD_TOLERANCE, (name, err)


@pytest.mark.heavy
def test_gradient_checkpointing_accumulation_clipping_and_an_optimizer_step(tiny_checkpoint):
    model = trainable(tiny_checkpoint, torch.bfloat16)
    ids, mask = pad_sequences(make_samples(model.config.vocab_size, lengths=(9, 4, 12)), side="left")
    plain = parameter_grads(model, ids, mask)
    # transformers 5.24 renames gradient_* to activation_checkpointing_*; older 5.x has only the former.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = parameter_grads(model, ids, mask)
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert not model.is_gradient_checkpointing
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain), "recomputation gives the same bits"

    # Accumulating two micro-batches: each half's gradients are deterministic, so the sum is too.
    def accumulated():
        model.zero_grad(set_to_none=True)
        for rows in (slice(0, 1), slice(1, 3)):
            logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits
            logits.float().logsumexp(-1).mul(mask[rows]).sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(accumulated(), accumulated()))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isfinite(norm)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=0.05).step()  # > a bf16 ulp of the norm weights (about 1)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # Parameters are the model's own: state_dict round-trips, and the patched model keeps working.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits.float()).all()


def test_train_mode_with_attention_dropout_is_refused(tmp_path):
    path = save_random_checkpoint(tmp_path / "dropout", random_config("qwen2", "tiny", attention_dropout=0.1))
    model = make_invariant(load_model(path, torch.float32))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=ids)  # eval: dropout off, accepted
    with pytest.raises(NonInvariantInputError, match="attention_dropout=0.1"):
        model.train()(input_ids=ids)


def packed_embeds_grads(model, samples, cotangents, flash_kwargs):
    """Per-sample d(sum(logits * cotangent)) / d inputs_embeds from one packed row, as
    DataCollatorWithFlattening builds it."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": s.tolist()} for s in samples])
    del batch["labels"]
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, **batch).logits[0]
    bounds = torch.tensor([0] + [len(s) for s in samples]).cumsum(0).tolist()
    sum(((logits[a:b].float() * c).sum() for a, b, c in zip(bounds, bounds[1:], cotangents))).backward()
    return logits.detach(), [embeds.grad[0, a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_forward_and_backward_equal_each_sequence_alone(family_checkpoints, family):
    model = trainable(family_checkpoints(family), torch.bfloat16)
    samples = make_samples(model.config.vocab_size, lengths=(7, 1, 11, 4))
    g = torch.Generator().manual_seed(2)
    cotangents = [torch.randn(len(s), model.config.vocab_size, generator=g) for s in samples]
    alone = [embeds_grad(model, samples, [i], "left", 0, cotangents) for i in range(len(samples))]
    alone_logit = [alone_logits(model.train(), s) for s in samples]
    for flash_kwargs in (False, True):
        logits, grads = packed_embeds_grads(model.train(), samples, cotangents, flash_kwargs)
        bounds = torch.tensor([0] + [len(s) for s in samples]).cumsum(0).tolist()
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            assert torch.equal(logits[a:b], alone_logit[i]), (flash_kwargs, i)
            assert torch.equal(grads[i], alone[i][0]), (flash_kwargs, i)


@pytest.mark.gpu
def test_training_at_qwen25_widths_on_cuda(tmp_path):
    """Qwen2.5-1.5B widths (two layers): train-mode logits equal inference, a sample's input gradient is
    the same alone and in a padded batch, and a micro-batch's parameter gradients repeat bitwise."""
    config = random_config("qwen2", "qwen2.5-1.5b", num_hidden_layers=2)
    model = trainable(save_random_checkpoint(tmp_path / "q", config), torch.bfloat16).cuda()
    samples = [s.cuda() for s in make_samples(config.vocab_size, lengths=(70, 9, 130))]
    alone = [alone_logits(model, s) for s in samples]
    model.train()
    ids, mask = pad_sequences(samples, side="left", device="cuda")
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert all(torch.equal(logits[r][mask[r].bool()], alone[r]) for r in range(len(samples)))
    del logits
    assert input_gradient_mismatches(model, samples) == []
    first, second = parameter_grads(model, ids, mask), parameter_grads(model, ids, mask)
    assert all(torch.equal(first[n], second[n]) for n in first)
