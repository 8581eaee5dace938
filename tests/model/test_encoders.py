"""Encoders (BERT, XLM-RoBERTa) on the invariant kernels, loaded as users load them (``AutoModel`` and
``AutoModelForSequenceClassification`` from a saved checkpoint): each row's real-token hidden states,
pooler output and classification logits alone are bitwise those it gets in batches of 7 and of all, in
shuffled order, padded on the right and on the left; a batch-size-keyed linear breaks that; accuracy
against the stock model in float64; ``strict=True``'s audit; ``restore``; the refusals by name. ModernBERT's
own layout is tested in ``test_modernbert.py``."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, BertForMaskedLM

from helpers.controls import m_dependent_linear
from invariant_infer import audit, make_invariant, restore
from invariant_infer.errors import NonInvariantInputError, NonInvariantOpError, UnsupportedModelError
from invariant_infer.model import encoder as encoder_module, layer_forwards, patch as patch_module
from invariant_infer.model.support import BY_NAME
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint

ENCODERS = ["bert", "xlm-roberta"]
HEADS = {"base": AutoModel, "classifier": AutoModelForSequenceClassification}
NUM_LABELS = {"bert": 3, "xlm-roberta": 1}  # a classifier; a cross-encoder reranker's one score
LENGTHS = (3, 12, 5, 9, 4, 14, 2, 10)
SHUFFLED = (4, 1, 7, 0, 3, 6, 2, 5)
# The invariant model vs the stock model in float64 with the same weights, relative to the largest reference
# value (measured on these checkpoints: under 5e-7 in fp32, under 1.1e-2 in bf16).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -5}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("encoders")
    return {(family, head): save_random_checkpoint(root / f"{family}-{head}",
                                                   random_config(family, "tiny", num_labels=NUM_LABELS[family]),
                                                   auto_class=auto_class)
            for family in ENCODERS for head, auto_class in HEADS.items()}


def load(checkpoints, family: str, head: str, dtype=torch.float32):
    return HEADS[head].from_pretrained(checkpoints[(family, head)], dtype=dtype).eval()


def samples(config) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(token ids, token type ids) per sample: no pad token inside; BERT's as sentence pairs (types 0 then 1)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, config.vocab_size, (n,), generator=g)
        pair = torch.cat([torch.zeros((n + 1) // 2), torch.ones(n // 2)]).long()
        out.append((ids, pair if config.type_vocab_size > 1 else None))
    return out


def run(model, rows, order, side: str = "right") -> dict[int, dict[str, torch.Tensor]]:
    """One forward of the samples ``order`` in one batch padded on ``side``: each sample's outputs."""
    width = max(len(rows[i][0]) for i in order)
    ids = torch.full((len(order), width), model.config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    spans = {}
    for r, i in enumerate(order):
        n = len(rows[i][0])
        start = width - n if side == "left" else 0
        ids[r, start:start + n], mask[r, start:start + n] = rows[i][0], 1
        if rows[i][1] is not None:
            types[r, start:start + n] = rows[i][1]
        spans[i] = (r, slice(start, start + n))
    inputs = dict(input_ids=ids, attention_mask=mask)
    if rows[0][1] is not None:
        inputs["token_type_ids"] = types
    with torch.no_grad():
        out = model(**inputs)
    if hasattr(out, "logits"):
        return {i: {"logits": out.logits[r]} for i, (r, _) in spans.items()}
    return {i: {"hidden": out.last_hidden_state[r, cols], "pooled": out.pooler_output[r]}
            for i, (r, cols) in spans.items()}


def differing(alone: dict, batched: dict) -> list:
    return [(i, key) for i in batched for key in batched[i] if not torch.equal(alone[i][key], batched[i][key])]


# The fast tier: BERT's base model and XLM-R's classifier (every family and head once); the rest is heavy.
@pytest.mark.fast_cells(ids=["bert-base-fp32", "xlm-roberta-classifier-fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.heavy)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", ENCODERS)
def test_rows_alone_equal_rows_in_any_batch(checkpoints, family, head, dtype):
    model = make_invariant(load(checkpoints, family, head, dtype))
    rows = samples(model.config)
    alone = {}
    for i in range(len(rows)):
        alone.update(run(model, rows, [i]))
    for side in ("right", "left"):
        for order in (SHUFFLED[:7], SHUFFLED):
            assert not differing(alone, run(model, rows, order, side)), (side, order)


@pytest.mark.fast_cells(ids=["bert-base", "xlm-roberta-classifier"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", ENCODERS)
def test_negative_control_a_batch_size_keyed_linear_breaks_it(checkpoints, family, head, monkeypatch):
    """BLOCK_K picked by the number of rows: the short rows alone (at most 4 tokens, or one pooled row) reduce
    in other blocks than in the batch, and the comparison above sees it."""
    monkeypatch.setattr(layer_forwards, "linear", m_dependent_linear)
    model = make_invariant(load(checkpoints, family, head))
    rows = samples(model.config)
    short = [i for i, n in enumerate(LENGTHS) if n <= 4]
    alone = {}
    for i in short:
        alone.update(run(model, rows, [i]))
    batched = run(model, rows, SHUFFLED, "left")
    assert differing(alone, {i: batched[i] for i in short})


def worst_errors(model, reference) -> dict[str, float]:
    """Each row in a left-padded batch against the reference on that row alone (stock takes the first column
    as the first token, so it runs unpadded): per output, the largest error relative to the largest reference
    value over the rows (a reranker's one logit per row may cancel to near 0)."""
    rows = samples(model.config)
    batched = run(model, rows, SHUFFLED, "left")
    errors, scales = {}, {}
    for i in range(len(rows)):
        want = run(reference, rows, [i])[i]
        for key, value in batched[i].items():
            errors[key] = max(errors.get(key, 0.0), (value.double() - want[key]).abs().max().item())
            scales[key] = max(scales.get(key, 0.0), want[key].abs().max().item())
    return {key: errors[key] / scales[key] for key in errors}


@pytest.mark.fast_cells(ids=["bert-classifier-fp32", "xlm-roberta-base-fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.heavy)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", ENCODERS)
def test_accuracy_against_the_stock_model_in_float64(checkpoints, family, head, dtype):
    # The reference holds the same weights (rounded to ``dtype``), in float64.
    worst = worst_errors(make_invariant(load(checkpoints, family, head, dtype)),
                         load(checkpoints, family, head, dtype).double())
    assert max(worst.values()) <= TOLERANCE[dtype], worst


def test_negative_control_the_tolerance_sees_a_pooler_on_the_first_column(checkpoints, monkeypatch):
    """The pooler on the first column, as stock pools: under left padding a pad, outside the tolerance."""
    monkeypatch.setattr(encoder_module, "_first_tokens", lambda hidden: hidden[:, 0])
    worst = worst_errors(make_invariant(load(checkpoints, "bert", "classifier")),
                         load(checkpoints, "bert", "classifier").double())
    assert max(worst.values()) > 10 * TOLERANCE[torch.float32], worst


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", ENCODERS)
def test_strict_passes_and_the_stock_forward_is_reported(checkpoints, family, head):
    stock = audit(load(checkpoints, family, head))
    assert not stock.ok and any(op.startswith(("aten.mm", "aten.addmm", "aten.bmm")) for _, op in stock.stray)
    model = make_invariant(load(checkpoints, family, head), strict=True)
    assert patch_module.is_invariant(model)


def test_strict_refuses_a_hook_that_reduces_and_restores(checkpoints):
    model = load(checkpoints, "bert", "classifier")
    model.bert.encoder.layer[0].output.register_forward_hook(lambda module, args, out: out + out.sum(-1, keepdim=True))
    with pytest.raises(NonInvariantOpError, match="bert.encoder.layer.0.output"):
        make_invariant(model, strict=True)
    assert not patch_module.is_invariant(model) and "forward" not in model.classifier.__dict__


@pytest.mark.parametrize("family", ENCODERS)
def test_restore_gives_back_the_stock_forward(checkpoints, family):
    stock = load(checkpoints, family, "classifier")
    model = load(checkpoints, family, "classifier")
    attn = model.config._attn_implementation
    rows = samples(model.config)
    assert make_invariant(make_invariant(model)) is model  # idempotent: one set of hooks
    assert len(model.base_model._forward_pre_hooks) == 1
    patched = run(model, rows, SHUFFLED, "right")
    restore(model)
    assert not [name for name, module in model.named_modules() if "forward" in module.__dict__]
    assert model.config._attn_implementation == attn and "generate" not in model.__dict__
    assert not model._forward_pre_hooks and not model.base_model._forward_pre_hooks
    restored, want = run(model, rows, SHUFFLED, "right"), run(stock, rows, SHUFFLED, "right")
    assert not differing(want, restored)
    assert differing(want, patched)  # control: the patched forward computes other bits than stock's


# ---- refusals by name ------------------------------------------------------------------------------

def test_other_encoder_heads_and_configurations_are_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM is not supported yet"):
        make_invariant(BertForMaskedLM(random_config("bert", "tiny")).eval())
    with pytest.raises(UnsupportedModelError, match="is_decoder"):
        make_invariant(random_model(random_config("bert", "tiny", is_decoder=True)))
    with pytest.raises(UnsupportedModelError, match="hidden_act 'relu'"):
        make_invariant(random_model(random_config("xlm-roberta", "tiny", hidden_act="relu")))


def test_inputs_no_row_of_which_is_invariant_are_refused(checkpoints):
    model = make_invariant(load(checkpoints, "bert", "base"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        with pytest.raises(NonInvariantInputError, match="holes"):
            model(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1, 1]]))
        with pytest.raises(NonInvariantInputError, match=re.escape(BY_NAME["encoder_packed_rows"].message("model"))):
            model(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1]]))
        model.train()
        with pytest.raises(NonInvariantInputError, match="train mode"):
            model(input_ids=ids)
    model.eval()
    with pytest.raises(UnsupportedModelError, match=re.escape(BY_NAME["encoder"].message("generate"))):
        model.generate(input_ids=ids)
