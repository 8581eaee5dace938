"""``PooledModel`` and ``load_pooled_model``: the task each checkpoint layout is read as, and each row's
output from one padded forward equal, bitwise, to the row alone and to sentence-transformers' own
``encode`` / ``predict`` on the invariant model; a batch-size-keyed linear (the negative control) breaks
the first equality. Refusals are named."""
import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

from helpers.controls import m_dependent_linear
from helpers.pooled_checkpoints import KINDS, PAIRS, TEXTS, save_bpe_tokenizer, save_pooled_checkpoint
from helpers.unsupported_checkpoints import save_sequence_classification_checkpoint
from invariant_infer import make_invariant
from invariant_infer.checkpoints.pooled_loading import load_pooled_model, pooling_task_of
from invariant_infer.errors import InvalidArgumentError, UnsupportedModelError
from invariant_infer.model import pooling
from invariant_infer.model.pooled_model import PooledInput
from invariant_infer.testing.random_checkpoints import qwen2_config, save_random_checkpoint


@pytest.fixture(scope="module")
def pooled_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooled")
    return {kind: save_pooled_checkpoint(kind, root) for kind in KINDS}


def rows_of(pooled, count=len(TEXTS)):
    if pooled.task == "score":
        return [pooled.tokenize_pair(a, b) for a, b in PAIRS[:count]]
    return [pooled.tokenize(text) for text in TEXTS[:count]]


def batch_mismatches(pooled, rows) -> int:
    """Rows whose output in one shuffled batch differs from the row alone."""
    alone = [pooled.forward_rows([row])[0] for row in rows]
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    batched = pooled.forward_rows([rows[i] for i in order])
    return sum(not torch.equal(batched[slot], alone[i]) for slot, i in enumerate(order))


# ---- the task of each layout -----------------------------------------------------------------------

def test_the_task_of_each_layout(pooled_paths, tmp_path):
    assert {kind: pooling_task_of(path) for kind, path in pooled_paths.items()} == {
        "bert-embedder": "embed", "qwen3-embedder": "embed", "xlm-roberta-cross-encoder": "score",
        "qwen3-reward": "reward"}
    root = pooled_paths["bert-embedder"].parent
    assert pooling_task_of(root / "bert-base") == "embed" and pooling_task_of(root / "qwen3-base") == "embed"
    assert pooling_task_of(root / "xlm-roberta-head") == "score"  # a one-label encoder head: a cross-encoder
    assert pooling_task_of(save_sequence_classification_checkpoint(tmp_path / "classifier")) == "classify"
    assert pooling_task_of(save_random_checkpoint(tmp_path / "lm", qwen2_config("tiny"))) is None


def test_sentence_transformers_layouts_give_their_pooling(pooled_paths):
    bert = load_pooled_model(pooled_paths["bert-embedder"], device="cpu")
    qwen3 = load_pooled_model(pooled_paths["qwen3-embedder"], device="cpu")
    assert (bert.pooling_mode, bert.normalize, bert.padding_side, bert.dimensions) == ("cls", True, "right", 64)
    assert (qwen3.pooling_mode, qwen3.normalize, qwen3.padding_side) == ("lasttoken", True, "left")
    assert bert.tokenize_pair("a", "dog").token_type_ids == [0, 0, 0, 1, 1]  # [CLS] a [SEP] dog [SEP]
    reward = load_pooled_model(pooled_paths["qwen3-reward"], device="cpu")
    assert (reward.task, reward.labels, reward.dimensions, reward.pooling_mode) == ("reward", ["LABEL_0"], 1, None)


# ---- bitwise: alone == in a batch, == sentence-transformers ------------------------------------------

@pytest.mark.fast_cells(ids=["bert-embedder", "qwen3-reward"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_row_alone_equals_the_row_in_a_shuffled_batch(pooled_paths, kind):
    pooled = load_pooled_model(pooled_paths[kind], device="cpu")
    rows = rows_of(pooled, 4)  # the longest text, a one-word one and two between
    out = pooled.forward_rows(rows)
    assert out.dtype == torch.float32 and out.shape == (len(rows), pooled.dimensions)
    assert batch_mismatches(pooled, rows) == 0


def test_negative_control_a_batch_size_keyed_linear_moves_the_rows(pooled_paths, monkeypatch):
    monkeypatch.setattr("invariant_infer.model.layer_forwards.linear", m_dependent_linear)
    pooled = load_pooled_model(pooled_paths["bert-embedder"], device="cpu")
    assert batch_mismatches(pooled, rows_of(pooled, 4)) > 0


@pytest.mark.parametrize("kind", ["bert-embedder", pytest.param("qwen3-embedder", marks=pytest.mark.heavy)])
def test_embeddings_equal_sentence_transformers_encode_on_the_invariant_model(pooled_paths, kind):
    import sentence_transformers as st
    pooled = load_pooled_model(pooled_paths[kind], device="cpu")
    model = make_invariant(st.SentenceTransformer(str(pooled_paths[kind]), device="cpu"))
    want = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_tensor=True)
    assert torch.equal(pooled.embeddings(pooled.forward_rows(rows_of(pooled))), want)


@pytest.mark.heavy
def test_modernbert_embedder_rows_alone_equal_batched_and_sentence_transformers_encode(tmp_path, monkeypatch):
    """A sentence-transformers folder over ModernBERT (mean pooling, Normalize): embed task, each row alone ==
    in a shuffled batch (texts longer than the 8-token window among them), == encode on the invariant model;
    a batch-size-keyed linear breaks the first equality."""
    import sentence_transformers as st
    path = save_pooled_checkpoint("modernbert-embedder", tmp_path)
    assert pooling_task_of(path) == "embed"
    pooled = load_pooled_model(path, task="embed", device="cpu")
    assert (pooled.pooling_mode, pooled.normalize, pooled.padding_side) == ("mean", True, "right")
    rows = rows_of(pooled)
    assert max(len(row.input_ids) for row in rows) > pooled.config.local_attention
    assert batch_mismatches(pooled, rows) == 0
    model = make_invariant(st.SentenceTransformer(str(path), device="cpu"))
    want = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_tensor=True)
    assert torch.equal(pooled.embeddings(pooled.forward_rows(rows)), want)
    monkeypatch.setattr("invariant_infer.model.layer_forwards.linear", m_dependent_linear)
    assert batch_mismatches(load_pooled_model(path, task="embed", device="cpu"), rows_of(pooled, 4)) > 0


def test_cross_encoder_scores_equal_sentence_transformers_predict_on_the_invariant_model(pooled_paths):
    import sentence_transformers as st
    pooled = load_pooled_model(pooled_paths["xlm-roberta-cross-encoder"], device="cpu")
    model = make_invariant(st.CrossEncoder(str(pooled_paths["xlm-roberta-cross-encoder"]), device="cpu"))
    want = model.predict(PAIRS, batch_size=len(PAIRS), activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    assert torch.equal(pooled.forward_rows(rows_of(pooled))[:, 0], want)


def test_reward_equals_the_invariant_transformers_model(pooled_paths):
    path = pooled_paths["qwen3-reward"]
    pooled = load_pooled_model(path, device="cpu")
    model = make_invariant(AutoModelForSequenceClassification.from_pretrained(path).eval())
    batch = PreTrainedTokenizerFast.from_pretrained(path)(TEXTS[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**batch).logits
    assert torch.equal(pooled.forward_rows(rows_of(pooled, 4)), want)


def test_stock_baseline_is_the_unpatched_model_within_fp32_error(pooled_paths):
    """invariant=False: the stock model, pooled the same way; its fp32 embeddings near the invariant ones."""
    invariant = load_pooled_model(pooled_paths["bert-embedder"], device="cpu")
    stock = load_pooled_model(pooled_paths["bert-embedder"], device="cpu", invariant=False)
    assert not hasattr(stock.model, "_invariant_infer_state") or stock.model is not invariant.model
    got, want = (m.embeddings(m.forward_rows(rows_of(m, 4))) for m in (invariant, stock))
    assert (got - want).abs().max().item() <= 1e-5


# ---- outputs row by row ---------------------------------------------------------------------------

def test_matryoshka_truncates_then_normalises_and_refuses_other_widths(pooled_paths, tmp_path):
    folder = tmp_path / "matryoshka"
    shutil.copytree(pooled_paths["bert-embedder"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    pooled = load_pooled_model(folder, device="cpu")
    assert pooled.matryoshka_dimensions == (16, 32)
    raw = pooled.forward_rows(rows_of(pooled, 3))
    short = pooled.embeddings(raw, dimensions=16)
    assert short.shape == (3, 16) and torch.equal(short, pooling.normalize(raw[:, :16].contiguous()))
    for bad in (8, 0, 65):
        with pytest.raises(InvalidArgumentError, match=f"dimensions={bad} is not supported"):
            pooled.embeddings(raw, dimensions=bad)
    plain = load_pooled_model(pooled_paths["bert-embedder"], device="cpu")
    with pytest.raises(InvalidArgumentError, match="not a Matryoshka model"):
        plain.embeddings(raw, dimensions=16)


def test_activations_are_each_rows_own_in_float64(pooled_paths):
    pooled = load_pooled_model(pooled_paths["xlm-roberta-cross-encoder"], device="cpu")
    logits = torch.tensor([[0.5], [-3.0], [40.0]])
    assert (pooled.activations(logits) - torch.sigmoid(logits.double())).abs().max() <= 1e-15
    assert torch.equal(pooled.activations(logits[1:2]), pooled.activations(logits)[1:2])
    pooled.task = "classify"
    wide = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    probs = pooled.activations(wide)
    assert probs.dtype == torch.float64 and (probs - torch.softmax(wide.double(), -1)).abs().max() <= 1e-15
    assert all(torch.equal(pooled.activations(wide[i:i + 1])[0], probs[i]) for i in range(5))
    pooled.task = "reward"
    assert torch.equal(pooled.activations(wide), wide.double())


# ---- refusals -----------------------------------------------------------------------------------------

def test_refusals_name_what_is_not_served(pooled_paths, tmp_path):
    root = pooled_paths["bert-embedder"].parent
    with pytest.raises(UnsupportedModelError, match="the classify task needs a sequence-classification head"):
        load_pooled_model(root / "bert-base", task="classify", device="cpu")
    lm = save_random_checkpoint(tmp_path / "lm", qwen2_config("tiny"))
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM is not a pooled architecture"):
        load_pooled_model(lm, device="cpu")
    with pytest.raises(UnsupportedModelError, match="the reward task needs a sequence-classification head"):
        load_pooled_model(lm, task="reward", device="cpu")
    save_bpe_tokenizer(lm)
    embedder = load_pooled_model(lm, task="embed", device="cpu")  # a causal LM's base model, pooled as vLLM does
    assert (embedder.task, embedder.pooling_mode, embedder.normalize) == ("embed", "lasttoken", True)
    assert embedder.forward_rows([PooledInput([5, 6, 7])]).shape == (1, embedder.dimensions)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"],
                                                  "id2label": {"0": "LABEL_0"}}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not a family pooled models run"):
        load_pooled_model(gpt2, device="cpu")
    dense = tmp_path / "dense"
    shutil.copytree(pooled_paths["bert-embedder"], dense)
    modules = json.loads((dense / "modules.json").read_text())
    modules[2] = {**modules[2], "type": "sentence_transformers.sentence_transformer.modules.dense.Dense"}
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match=r"module 2 \(Dense\) is not supported"):
        pooling_task_of(dense)


def test_rows_longer_than_the_model_takes_are_refused_with_the_length(pooled_paths):
    pooled = load_pooled_model(pooled_paths["bert-embedder"], device="cpu")
    with pytest.raises(InvalidArgumentError, match=f"input of 200 tokens is longer than the model's maximum of "
                                                   f"{pooled.max_length} tokens"):
        pooled.forward_rows([PooledInput([5] * 200)])
    with pytest.raises(InvalidArgumentError, match="empty input"):
        pooled.check_length(PooledInput([]))
