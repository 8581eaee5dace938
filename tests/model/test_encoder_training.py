"""Training BERT and XLM-RoBERTa classifiers through the invariant kernels (eval mode, autograd recording),
loaded as users load them: each example's loss and its gradient with respect to its input embeddings alone
are bitwise those it gets in a shuffled batch, padded on the right and on the left (pads get no gradient);
a batch-size-keyed linear breaks that; accuracy against stock autograd in float64; train mode (dropout)
refused by name; optimizer steps on a fixed batch give the same weights run after run.

Summed parameter gradients are not compared across batches: they add up the batch's rows by definition."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from invariant_infer import make_invariant
from invariant_infer.errors import NonInvariantInputError
from invariant_infer.kernels import LinearConfig, linear_autograd, linear_config
from invariant_infer.model import attention as attention_module, layer_forwards
from invariant_infer.model.support import BY_NAME, supports
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

ENCODERS = ["bert", "xlm-roberta"]
NUM_LABELS = 3
LENGTHS = (3, 9, 4, 6, 2)
SHUFFLED = (3, 0, 4, 2, 1)
LABELS = torch.tensor([0, 2, 1, 1, 2])
# Invariant model (fp32) vs stock autograd in float64, same weights, each example alone: the loss's absolute
# error, and d inputs_embeds' largest error relative to its largest element (measured: under 1e-7 / 4e-7).
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-6, 3e-6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("encoder_training")
    return {family: save_random_checkpoint(root / family,
                                           random_config(family, "tiny", num_labels=NUM_LABELS, num_hidden_layers=1),
                                           auto_class=AutoModelForSequenceClassification)
            for family in ENCODERS}


def load(checkpoints, family: str, dtype=torch.float32, **kwargs):
    return AutoModelForSequenceClassification.from_pretrained(checkpoints[family], dtype=dtype, **kwargs).eval()


def embeddings(config) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, config.hidden_size, generator=g) for n in LENGTHS]


def run(model, rows, order, side: str = "right") -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One forward and backward of the examples ``order`` in one batch padded on ``side``: each example's
    (loss, d inputs_embeds over its real tokens). Asserts its pad positions get no gradient."""
    width = max(len(rows[i]) for i in order)
    x = torch.zeros(len(order), width, model.config.hidden_size)
    mask = torch.zeros(len(order), width, dtype=torch.long)
    spans = {}
    for r, i in enumerate(order):
        start = width - len(rows[i]) if side == "left" else 0
        cols = slice(start, start + len(rows[i]))
        x[r, cols], mask[r, cols] = rows[i], 1
        spans[i] = (r, cols)
    x.requires_grad_()
    logits = model(inputs_embeds=x, attention_mask=mask).logits
    losses = F.cross_entropy(logits, LABELS[list(order)], reduction="none")
    losses.sum().backward()
    assert not x.grad[mask == 0].any()
    return {i: (losses[r].detach(), x.grad[r, cols]) for i, (r, cols) in spans.items()}


def mismatched(alone: dict, batched: dict) -> list[int]:
    return [i for i in batched if not (torch.equal(alone[i][0], batched[i][0])
                                       and torch.equal(alone[i][1], batched[i][1]))]


@pytest.mark.parametrize("family", ENCODERS)
def test_each_examples_loss_and_input_gradient_are_batch_invariant(checkpoints, family):
    model = make_invariant(load(checkpoints, family))
    assert all(p.requires_grad for p in model.parameters()) and torch.is_grad_enabled()
    rows = embeddings(model.config)
    alone = {}
    for i in range(len(rows)):
        alone.update(run(model, rows, [i]))
    assert all(grad.abs().sum() > 0 for _, grad in alone.values())
    for side in ("right", "left"):
        assert mismatched(alone, run(model, rows, SHUFFLED, side)) == [], side


def _batch_size_keyed_linear_autograd(x, weight, bias=None, config=None, grad_input_config=None):
    """Negative control: BLOCK_K of the forward and of d x picked by the row count, as batch-size-keyed
    heuristics do (``helpers.controls.m_dependent_linear``, differentiable)."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    block_k = 16 if m <= 4 else 64
    forward = linear_config(x.device.type, x.dtype, *weight.shape)
    backward = linear_config(x.device.type, x.dtype, weight.shape[1], weight.shape[0])
    return linear_autograd(x, weight, bias, config=LinearConfig(forward.block_m, forward.block_n, block_k),
                           grad_input_config=LinearConfig(backward.block_m, backward.block_n, block_k))


def test_negative_control_a_batch_size_keyed_linear_breaks_it(checkpoints, monkeypatch):
    """The short examples (at most 4 tokens) alone reduce in other blocks than in the batch."""
    monkeypatch.setattr(layer_forwards, "linear_autograd", _batch_size_keyed_linear_autograd)
    model = make_invariant(load(checkpoints, "bert"))
    rows = embeddings(model.config)
    short = [i for i, n in enumerate(LENGTHS) if n <= 4]
    alone = {}
    for i in short:
        alone.update(run(model, rows, [i]))
    batched = run(model, rows, SHUFFLED, "left")
    assert mismatched(alone, {i: batched[i] for i in short})


def worst_errors(model, stock) -> tuple[float, float]:
    """The largest loss error and relative d inputs_embeds error over the examples, in a left-padded batch."""
    rows = embeddings(model.config)
    batched = run(model, rows, SHUFFLED, "left")
    loss_error = grad_error = 0.0
    for i, row in enumerate(rows):
        x = row[None].double().requires_grad_()
        loss = F.cross_entropy(stock(inputs_embeds=x).logits, LABELS[i:i + 1])
        loss.backward()
        loss_error = max(loss_error, abs(batched[i][0].item() - loss.item()))
        grad_error = max(grad_error, ((batched[i][1].double() - x.grad[0]).abs().max() / x.grad.abs().max()).item())
    return loss_error, grad_error


@pytest.mark.parametrize("family", ENCODERS)
def test_loss_and_input_gradient_match_stock_autograd_in_float64(checkpoints, family):
    loss_error, grad_error = worst_errors(make_invariant(load(checkpoints, family)),
                                         load(checkpoints, family, torch.float64, attn_implementation="eager"))
    assert loss_error <= LOSS_TOLERANCE and grad_error <= GRAD_TOLERANCE, (loss_error, grad_error)


def test_negative_control_the_tolerance_sees_the_causal_attention_backward(checkpoints, monkeypatch):
    """The causal backward on the bidirectional forward (every query placed past the row): the attention
    passes no gradient to its queries, keys and values, outside the tolerance (measured: about 1e-2)."""
    attend = attention_module.attend
    monkeypatch.setattr(attention_module, "attend", lambda *args, causal=True, **kwargs: attend(*args, **kwargs))
    _, grad_error = worst_errors(make_invariant(load(checkpoints, "bert")),
                                 load(checkpoints, "bert", torch.float64, attn_implementation="eager"))
    assert grad_error > 100 * GRAD_TOLERANCE, grad_error


def test_train_mode_is_refused_by_name_and_eval_mode_training_is_supported(checkpoints):
    assert supports("encoder", "training")
    model = make_invariant(load(checkpoints, "bert")).train()
    x = torch.zeros(1, 3, model.config.hidden_size)
    with pytest.raises(NonInvariantInputError, match=re.escape(BY_NAME["encoder_train_mode"].message("training"))):
        model(inputs_embeds=x)
    with torch.no_grad(), \
            pytest.raises(NonInvariantInputError, match=re.escape(BY_NAME["encoder_train_mode"].message("model"))):
        model(inputs_embeds=x)


def test_optimizer_steps_on_a_fixed_batch_give_the_same_weights_twice(checkpoints):
    def train() -> dict[str, torch.Tensor]:
        model = make_invariant(load(checkpoints, "xlm-roberta"))
        rows = embeddings(model.config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            optimizer.zero_grad()
            run(model, rows, SHUFFLED, "left")
            optimizer.step()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    first, second = train(), train()
    assert all(torch.equal(first[name], second[name]) for name in first)
    initial = dict(load(checkpoints, "xlm-roberta").named_parameters())
    assert not torch.equal(first["classifier.out_proj.weight"], initial["classifier.out_proj.weight"])
