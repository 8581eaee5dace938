"""ModernBERT on the invariant kernels, loaded as users load it (``AutoModel`` and
``AutoModelForSequenceClassification`` from a saved checkpoint; a sentence-transformers embedder on it):
a tiny model with a global layer and a local one whose window (8 tokens, 4 on each side) is shorter than
most samples. Each row's real-token hidden states and logits alone are bitwise those it gets in batches of
7 and of all, shuffled, padded on the right and on the left; a batch-size-keyed linear breaks that;
accuracy against the stock model in float64, and a wrong window or none misses it by far; ``strict=True``'s
audit; ``restore``. The bidirectional window on its own: against a float64 reference on rows longer than
a KV chunk, bitwise whatever the padding and the batch, and a batch-keyed attention tile breaks that."""
from __future__ import annotations

import importlib
import random

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification

from helpers.controls import m_dependent_linear
from invariant_infer import audit, make_invariant, restore
from invariant_infer.errors import NonInvariantInputError, UnsupportedModelError
from invariant_infer.kernels.configs import AttentionConfig, attention_config
from invariant_infer.model import layer_forwards, modernbert as modernbert_module, patch as patch_module
from invariant_infer.model.attention import attend_bidirectional
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint

kernel_module = importlib.import_module("invariant_infer.kernels.attention")

# "classifier": pooled on the first token (ModernBERT's default), "mean-classifier": on the mean.
HEADS = {"base": (AutoModel, {}), "classifier": (AutoModelForSequenceClassification, {}),
         "mean-classifier": (AutoModelForSequenceClassification, {"classifier_pooling": "mean"})}
LENGTHS = (3, 12, 5, 9, 4, 14, 2, 10)
SHUFFLED = (4, 1, 7, 0, 3, 6, 2, 5)
# The invariant model vs the stock model in float64 with the same weights, relative to the largest reference
# value (measured on these checkpoints: under 2.3e-7 in fp32, under 6e-3 in bf16; no window: 3.5e-3).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -5}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("modernbert")
    return {head: save_random_checkpoint(root / head, random_config("modernbert", "tiny", num_labels=3, **overrides),
                                         auto_class=auto_class)
            for head, (auto_class, overrides) in HEADS.items()}


def load(checkpoints, head: str, dtype=torch.float32):
    return HEADS[head][0].from_pretrained(checkpoints[head], dtype=dtype).eval()


def samples(config) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, config.vocab_size, (n,), generator=g) for n in LENGTHS]


def run(model, rows, order, side: str = "right") -> dict[int, dict[str, torch.Tensor]]:
    """One forward of the samples ``order`` in one batch padded on ``side``: each sample's outputs."""
    width = max(len(rows[i]) for i in order)
    ids = torch.full((len(order), width), model.config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    spans = {}
    for r, i in enumerate(order):
        start = width - len(rows[i]) if side == "left" else 0
        ids[r, start:start + len(rows[i])], mask[r, start:start + len(rows[i])] = rows[i], 1
        spans[i] = (r, slice(start, start + len(rows[i])))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    if hasattr(out, "logits"):
        return {i: {"logits": out.logits[r]} for i, (r, _) in spans.items()}
    return {i: {"hidden": out.last_hidden_state[r, cols]} for i, (r, cols) in spans.items()}


def differing(alone: dict, batched: dict) -> list:
    return [(i, key) for i in batched for key in batched[i] if not torch.equal(alone[i][key], batched[i][key])]


@pytest.mark.fast_cells(ids=["base-fp32", "classifier-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", HEADS)
def test_rows_alone_equal_rows_in_any_batch(checkpoints, head, dtype):
    model = make_invariant(load(checkpoints, head, dtype))
    rows = samples(model.config)
    alone = {}
    for i in range(len(rows)):
        alone.update(run(model, rows, [i]))
    for side in ("right", "left"):
        for order in (SHUFFLED[:7], SHUFFLED):
            assert not differing(alone, run(model, rows, order, side)), (side, order)


@pytest.mark.fast_cells(ids=["classifier"])
@pytest.mark.parametrize("head", ["base", "classifier"])
def test_negative_control_a_batch_size_keyed_linear_breaks_it(checkpoints, head, monkeypatch):
    """BLOCK_K picked by the number of rows: the short rows alone (at most 4 tokens, or one pooled row) reduce
    in other blocks than in the batch, and the comparison above sees it."""
    monkeypatch.setattr(layer_forwards, "linear", m_dependent_linear)
    model = make_invariant(load(checkpoints, head))
    rows = samples(model.config)
    short = [i for i, n in enumerate(LENGTHS) if n <= 4]
    alone = {}
    for i in short:
        alone.update(run(model, rows, [i]))
    batched = run(model, rows, SHUFFLED, "left")
    assert differing(alone, {i: batched[i] for i in short})


def worst_errors(model, reference) -> dict[str, float]:
    """Each row in a left-padded batch against the reference on that row alone (stock counts positions
    from the first column and pools its first column, so it runs unpadded): per output, the largest error
    relative to the largest reference value over the rows."""
    rows = samples(model.config)
    batched = run(model, rows, SHUFFLED, "left")
    errors, scales = {}, {}
    for i in range(len(rows)):
        want = run(reference, rows, [i])[i]
        for key, value in batched[i].items():
            errors[key] = max(errors.get(key, 0.0), (value.double() - want[key]).abs().max().item())
            scales[key] = max(scales.get(key, 0.0), want[key].abs().max().item())
    return {key: errors[key] / scales[key] for key in errors}


@pytest.mark.fast_cells(ids=["mean-classifier-fp32", "base-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", HEADS)
def test_accuracy_against_the_stock_model_in_float64(checkpoints, head, dtype):
    # The reference holds the same weights (rounded to ``dtype``), in float64.
    worst = worst_errors(make_invariant(load(checkpoints, head, dtype)), load(checkpoints, head, dtype).double())
    assert max(worst.values()) <= TOLERANCE[dtype], worst


@pytest.mark.fast_cells(ids=["no-window"])
@pytest.mark.parametrize("change", [lambda half: None, lambda half: half + 1], ids=["no-window", "one-wider"])
def test_window_control_a_wrong_window_misses_the_stock_model(checkpoints, monkeypatch, change):
    """The local layer's window is what stock computes: without it, or one token wider on each side, the
    same comparison misses by far more than its tolerance."""
    def wrong_window(query, key, value, kv_start, kv_end, scale, half_window=None):
        half = half_window if half_window is None else change(half_window)
        return attend_bidirectional(query, key, value, kv_start, kv_end, scale, half)
    monkeypatch.setattr(modernbert_module, "attend_bidirectional", wrong_window)
    worst = worst_errors(make_invariant(load(checkpoints, "base")), load(checkpoints, "base").double())
    assert max(worst.values()) > 100 * TOLERANCE[torch.float32], worst


@pytest.mark.fast_cells(ids=["classifier"])
@pytest.mark.parametrize("head", HEADS)
def test_strict_passes_and_the_stock_forward_is_reported(checkpoints, head):
    stock = audit(load(checkpoints, head))
    assert not stock.ok and any(op.startswith(("aten.mm", "aten.addmm", "aten.bmm")) for _, op in stock.stray)
    model = make_invariant(load(checkpoints, head), strict=True)
    assert patch_module.is_invariant(model)


def test_restore_gives_back_the_stock_forward(checkpoints):
    stock = load(checkpoints, "classifier")
    model = load(checkpoints, "classifier")
    attn = model.config._attn_implementation
    rows = samples(model.config)
    assert make_invariant(make_invariant(model)) is model  # idempotent: one set of hooks
    assert len(model.model._forward_pre_hooks) == 1
    patched = run(model, rows, SHUFFLED, "right")
    restore(model)
    assert not [name for name, module in model.named_modules() if "forward" in module.__dict__]
    assert model.config._attn_implementation == attn and "generate" not in model.__dict__
    assert not model.model._forward_pre_hooks
    restored, want = run(model, rows, SHUFFLED, "right"), run(stock, rows, SHUFFLED, "right")
    assert not differing(want, restored)
    assert differing(want, patched)  # control: the patched forward computes other bits than stock's


def test_what_is_not_built_is_refused_by_name():
    from transformers import ModernBertForMaskedLM
    with pytest.raises(UnsupportedModelError, match="ModernBertForMaskedLM is not supported yet"):
        make_invariant(ModernBertForMaskedLM(random_config("modernbert", "tiny")).eval())
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'silu'"):
        make_invariant(random_model(random_config("modernbert", "tiny", hidden_activation="silu")))
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        make_invariant(random_model(random_config("modernbert", "tiny", rope_parameters={
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 160000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})))


# ---- the bidirectional window on the attention kernel ----------------------------------------------

HALF = 40  # 81 keys per window: windows cross the CPU config's 64-key blocks and 128-key chunks
ROW_LENGTHS = (200, 150, 70, 9)


def _rows(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 2, n, 16, generator=g).to(dtype) for n in ROW_LENGTHS]  # q, k, v: [H, n, D] each


def _attend_rows(rows, order, side, extra=0, half=HALF):
    """Each row of ``order`` in one batch padded on ``side`` (plus ``extra`` columns): its real queries' output."""
    width = max(rows[i].shape[2] for i in order) + extra
    qkv = torch.zeros(3, len(order), 2, width, 16, dtype=rows[0].dtype)
    starts = []
    for r, i in enumerate(order):
        n = rows[i].shape[2]
        start = width - n if side == "left" else 0
        qkv[:, r, :, start:start + n] = rows[i]
        starts.append(start)
    kv_start = torch.tensor(starts, dtype=torch.int32)
    kv_end = kv_start + torch.tensor([rows[i].shape[2] for i in order], dtype=torch.int32)
    out = attend_bidirectional(qkv[0], qkv[1], qkv[2], kv_start, kv_end, 0.25, half)
    return {i: out[r, starts[r]:starts[r] + rows[i].shape[2]] for r, i in enumerate(order)}


def _reference(row, half):
    q, k, v = row.double()
    n = q.shape[1]
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
    scores = (q @ k.transpose(-1, -2) * 0.25).masked_fill(distance > half, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, D]


def test_bidirectional_window_against_float64_and_bitwise_in_any_batch(half=HALF):
    rows = _rows()
    alone = {i: _attend_rows(rows, [i], "right", half=half)[i] for i in range(len(rows))}
    for i, row in enumerate(rows):
        want = _reference(row, half)
        assert (alone[i].double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        # window control: one key more on each side is far outside that tolerance
        wider = _reference(row, half + 1)
        assert row.shape[2] <= half + 1 or (wider - want).abs().max().item() > 1e-3 * want.abs().max().item()
    for side, extra in (("left", 0), ("right", 5), ("left", 37)):
        for order in ([2, 0, 3, 1], [1, 3]):
            batched = _attend_rows(rows, order, side, extra, half)
            assert all(torch.equal(batched[i], alone[i]) for i in order), (side, extra, order)


def test_bidirectional_window_in_bf16_is_bitwise_in_any_batch():
    rows = _rows(torch.bfloat16)[1:]
    alone = {i: _attend_rows(rows, [i], "right")[i] for i in range(len(rows))}
    batched = _attend_rows(rows, [2, 0, 1], "left", 11)
    assert all(torch.equal(batched[i], alone[i]) for i in alone)


def test_negative_control_a_batch_keyed_kv_block_breaks_the_window(monkeypatch):
    """KV blocks (and chunks) sized by the batch, as a batch-keyed tuner would: the rows alone reduce in other
    blocks than in the batch, and the comparison above sees it."""
    def by_batch(device_type, dtype, head_dim):
        base = attention_config(device_type, dtype, head_dim)
        return base if by_batch.rows > 1 else AttentionConfig(block_m=base.block_m, block_n=16, kv_chunk=32)
    monkeypatch.setattr(kernel_module, "attention_config", by_batch)
    rows = _rows()
    by_batch.rows = 1
    alone = {i: _attend_rows(rows, [i], "right")[i] for i in range(3)}
    by_batch.rows = 3
    batched = _attend_rows(rows, [2, 0, 1], "left")
    assert not all(torch.equal(batched[i], alone[i]) for i in alone)


# ---- a sentence-transformers embedder on it --------------------------------------------------------

@pytest.mark.heavy
def test_sentence_transformers_embedder_is_bitwise_alone_at_any_batch_size(checkpoints, tmp_path, monkeypatch):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import PreTrainedTokenizerFast

    from helpers.tokenizer import train_tokenizer
    path = tmp_path / "base"
    load(checkpoints, "base").save_pretrained(path)
    train_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    transformer = Transformer(str(path))
    model = st.SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean"),
                                            Normalize()], device="cpu")
    texts = ["the cat runs fast and the dog runs faster than the cat", "a dog", "model token batch score",
             "the", "prompt completion cat dog runs fast the a model token batch", "dog dog", "score sequence"]

    def mismatches(model):
        encode = lambda items, size: model.encode(items, batch_size=size, convert_to_tensor=True)  # noqa: E731
        alone = [encode([text], 1)[0] for text in texts]
        order = list(range(len(texts)))
        random.Random(0).shuffle(order)
        shuffled = encode([texts[i] for i in order], len(texts))
        return sum(not torch.equal(shuffled[slot], alone[i]) for slot, i in enumerate(order))

    assert mismatches(make_invariant(model)) == 0
    restore(model)
    monkeypatch.setattr(layer_forwards, "linear", m_dependent_linear)  # control: a batch-size-keyed linear
    assert mismatches(make_invariant(model)) > 0


def test_training_and_train_mode_are_refused(checkpoints):
    model = make_invariant(load(checkpoints, "base"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(NonInvariantInputError, match="training|backward"):
        model(input_ids=ids)  # grad enabled, parameters requiring grad
    model.requires_grad_(False)  # frozen weights, a gradient wanted for the inputs: still a backward
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with pytest.raises(NonInvariantInputError, match="training|backward"):
        model(inputs_embeds=embeds, attention_mask=torch.ones_like(ids))
    model.train()
    with torch.no_grad(), pytest.raises(NonInvariantInputError, match="train mode"):
        model(input_ids=ids)
