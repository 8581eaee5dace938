"""Embedders, reward models and cross-encoders, bitwise whatever the batch.

sentence-transformers embedders as Qwen3-Embedding is built (a Qwen3 base model, last-token pooling,
left padding, normalised) and a mean-pooling one padded on the right; Qwen3 and Llama reward models
(``*ForSequenceClassification``, one label); a CrossEncoder over the Qwen3 one, and one over a causal
LM (yes - no logits); BERT (mean) and XLM-R (cls) embedders, normalised, and CrossEncoders over their
one-label heads. Each is saved and loaded back as users load it. Every input's output alone == in
batches of 7 and in one shuffled batch of all, padded on either side; negative controls (a linear whose
K block follows the batch size, a pooling block that does) fail that check; accuracy against float64
stock is checked apart: the relative error at most twice stock fp32's own, or a stated tolerance.
"""
import functools
import json
import random

import pytest
import sentence_transformers as st
import torch
from sentence_transformers.cross_encoder.modules import LogitScore
from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
from transformers import AutoModel, AutoModelForSequenceClassification, PreTrainedTokenizerFast

from helpers.controls import m_dependent_linear
from helpers.pooled_checkpoints import save_roberta_tokenizer, save_wordpiece_tokenizer
from helpers.tokenizer import train_tokenizer
from invariant_infer import audit, is_invariant, make_invariant, restore
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.kernels import pool_tokens
from invariant_infer.kernels import pooling as pooling_kernel
from invariant_infer.model import pooling
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint


ONE_LAYER = {"num_hidden_layers": 1}  # a decoder's invariance is tested elsewhere; here the pooled outputs
TEXTS = ["the cat runs fast", "a dog", "model token batch score sequence invariant logits prompt", "the",
         "prompt completion cat dog runs fast the a model token", "dog dog", "score", "batch batch the invariant"]
PAIRS = [(TEXTS[i], TEXTS[(i + 3) % len(TEXTS)]) for i in range(len(TEXTS))]
CONTROL_ITEMS = 3  # the negative controls run the same check on the first three items: cheaper, and enough


def _tokenizer(path):
    train_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="module")
def qwen3_base(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("qwen3_base"), random_config("qwen3", "tiny", **ONE_LAYER))
    _tokenizer(path)
    return path


@pytest.fixture(scope="module")
def embedder_paths(qwen3_base, tmp_path_factory):
    """{name: path} of sentence-transformers embedders on the Qwen3 base model: last-token pooling with
    left padding and Normalize (as Qwen3-Embedding), mean pooling with right padding."""
    paths = {}
    for name, mode, side, extra in (("lasttoken-left", "lasttoken", "left", [Normalize()]),
                                    ("mean-right", "mean", "right", [])):
        transformer = Transformer(str(qwen3_base))
        transformer.tokenizer.padding_side = side
        model = st.SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), mode),
                                                *extra], device="cpu")
        paths[name] = tmp_path_factory.mktemp(name)
        model.save(str(paths[name]))
        config = json.loads((paths[name] / "tokenizer_config.json").read_text())
        (paths[name] / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": side}))
    return paths


@pytest.fixture(scope="module")
def reward_paths(tmp_path_factory):
    """{family: path} of one-label sequence-classification checkpoints (reward models), random init."""
    paths = {}
    for family in ("qwen3", "llama"):
        path = tmp_path_factory.mktemp(f"{family}_reward")
        tokenizer = _tokenizer(path)
        torch.manual_seed(0)
        config = random_config(family, "tiny", num_labels=1, pad_token_id=tokenizer.pad_token_id, **ONE_LAYER)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
        paths[family] = path
    return paths


def _load_embedder(path, dtype=torch.float32):
    return st.SentenceTransformer(str(path), device="cpu", model_kwargs={"dtype": dtype})


def _mismatches(run, items, alone=None):
    """How many items' outputs differ from the item run alone (batch size 1; ``alone``: those outputs
    already computed) in batches of 7 in order and in one batch of all, shuffled."""
    alone = alone if alone is not None else _alone(run, items)
    order = list(range(len(items)))
    random.Random(0).shuffle(order)
    in_sevens = run(items, 7)
    shuffled = run([items[i] for i in order], len(items))
    return (sum(not torch.equal(out, want) for out, want in zip(in_sevens, alone))
            + sum(not torch.equal(shuffled[slot], alone[i]) for slot, i in enumerate(order)))


def _alone(run, items):
    return [run([item], 1)[0] for item in items]


def _encode(model):
    return lambda texts, batch_size: model.encode(texts, batch_size=batch_size, convert_to_tensor=True)


# ---- sentence-transformers embedders ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("name", ["lasttoken-left", "mean-right"])
def test_encode_is_bitwise_alone_at_any_batch_size_and_order(embedder_paths, name, dtype):
    model = _load_embedder(embedder_paths[name], dtype)
    assert model[0].tokenizer.padding_side == name.split("-")[1]
    assert make_invariant(model) is model and is_invariant(model) and is_invariant(model[0].auto_model)
    assert _mismatches(_encode(model), TEXTS) == 0
    calls = []
    model[0].auto_model.register_forward_pre_hook(lambda *args: calls.append(1))
    model.encode(TEXTS, batch_size=len(TEXTS))
    assert len(calls) == 1  # a batch is one forward of the model


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["lasttoken-left", "mean-right"])
def test_encode_is_bitwise_alone_padded_on_the_other_side(embedder_paths, name, dtype):
    """The saved padding side flipped at run time: last-token pooling padded on the right, mean on the left."""
    model = make_invariant(_load_embedder(embedder_paths[name], dtype))
    side = "right" if name.endswith("left") else "left"
    model[0].tokenizer.padding_side = side
    assert _pads_on(model[0].tokenizer, side)
    assert _mismatches(_encode(model), TEXTS) == 0


def _pads_on(tokenizer, side) -> bool:
    """The tokenizer pads a short text (TEXTS[1]) beside a longer one on ``side``."""
    mask = tokenizer(TEXTS[:2], padding=True)["attention_mask"][1]
    return mask[0 if side == "left" else -1] == 0


def test_negative_control_a_pooling_block_picked_by_the_batch_size_fails(embedder_paths, monkeypatch):
    """The mean-pooling embedder with the pooling kernel's token block chosen by the batch size."""
    def block_by_batch(x, start, end, weighted=False, divisor="count"):
        with monkeypatch.context() as patch:
            patch.setattr(pooling_kernel, "BLOCK_T", 2 if x.shape[0] == 1 else 32)
            return pool_tokens(x, start, end, weighted, divisor)
    model = make_invariant(_load_embedder(embedder_paths["mean-right"]))
    monkeypatch.setattr(pooling, "pool_tokens", block_by_batch)
    assert _mismatches(_encode(model), TEXTS[:CONTROL_ITEMS]) > 0


def test_restore_undoes_the_patch_and_encode_matches_stock_within_tolerance(embedder_paths):
    """restore gives stock back (bitwise its encode before the patch); the invariant fp32 embedding's
    error against float64 stock (sentence-transformers' own pooling) is at most twice stock fp32's."""
    model = _load_embedder(embedder_paths["lasttoken-left"])
    stock = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_tensor=True)
    invariant = make_invariant(model).encode(TEXTS, batch_size=len(TEXTS), convert_to_tensor=True)
    restore(model)
    assert not is_invariant(model) and not is_invariant(model[0].auto_model)
    assert "forward" not in vars(model[1]) and "forward" not in vars(model[2])
    assert torch.equal(model.encode(TEXTS, batch_size=len(TEXTS), convert_to_tensor=True), stock)
    reference = _load_embedder(embedder_paths["lasttoken-left"], torch.float64).encode(
        TEXTS, batch_size=len(TEXTS), convert_to_tensor=True)
    error = lambda got: ((got.double() - reference).norm() / reference.norm()).item()  # noqa: E731
    assert 0 < error(invariant) <= 2 * error(stock), (error(invariant), error(stock))


@pytest.mark.parametrize("side", ["left", "right"])
def test_every_pooling_mode_matches_sentence_transformers_pooling(side):
    """pool() against sentence-transformers' own Pooling module on float64 states: cls, lasttoken and
    max exactly, the sums within 2^-20 of their scale (fp32 accumulation)."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 1, 20, 17]
    hidden = torch.randn(len(lengths), max(lengths) + 2, 32, generator=g, dtype=torch.float64)
    mask = torch.zeros(hidden.shape[:2], dtype=torch.int64)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, mask.shape[1] - n:] = 1
        else:
            mask[row, :n] = 1
    for mode in pooling.POOLING_MODES:
        want = Pooling(32, mode)({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
        got = pooling.pool(hidden.float(), mask, mode).double()
        if mode in ("cls", "lasttoken", "max"):
            assert torch.equal(got, want.float().double()), mode
        else:
            assert (got - want).abs().max().item() <= 2 ** -20 * hidden.abs().max().item(), mode


def test_unsupported_sentence_transformers_modules_are_refused_by_name(qwen3_base):
    transformer = Transformer(str(qwen3_base))
    dim = transformer.get_embedding_dimension()
    for modules, match in (([Pooling(dim, "mean", include_prompt=False)], "include_prompt=False"),
                           ([Pooling(dim, "mean"), Dense(dim, 8)], r"\(Dense\) is not supported")):
        model = st.SentenceTransformer(modules=[transformer, *modules], device="cpu")
        with pytest.raises(UnsupportedModelError, match=match):
            make_invariant(model)
        assert not is_invariant(model) and not is_invariant(transformer.auto_model)


# ---- reward models and the cross-encoder ---------------------------------------------------------------

# fp32 against float64 stock where the invariant summation order lands further from float64 than stock's
# (more than twice, on these models): a relative (Frobenius) error of at most 2^-20, about 8 fp32 ulps
# (measured: invariant under 2.7e-7, stock under 1.1e-7)
FP32_RELATIVE_TOLERANCE = 2 ** -20
# BLOCK_K by M: up to 8 rows (a text of up to 8 tokens alone) or more (any batch of them)
BATCH_BLOCKED_LINEAR = functools.partial(m_dependent_linear, small_m=8)


def _load_reward(path, dtype=torch.float32):
    return AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval()


def _rewards(model, tokenizer, side):
    def run(texts, batch_size):
        tokenizer.padding_side = side
        out = []
        for first in range(0, len(texts), batch_size):
            batch = tokenizer(texts[first:first + batch_size], padding=True, return_tensors="pt")
            with torch.no_grad():
                out += list(model(**batch).logits)
        return out
    return run


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("family", ["qwen3", pytest.param("llama", marks=pytest.mark.heavy)])
def test_reward_is_bitwise_alone_at_any_batch_size_order_and_padding_side(reward_paths, family, dtype):
    model = make_invariant(_load_reward(reward_paths[family], dtype))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(reward_paths[family])
    alone = _alone(_rewards(model, tokenizer, "left"), TEXTS)  # one text alone has no padding
    for side in ("left", "right"):
        assert _mismatches(_rewards(model, tokenizer, side), TEXTS, alone) == 0, side


@pytest.mark.heavy
def test_negative_control_a_linear_blocked_by_the_batch_size_moves_the_llama_reward(reward_paths, monkeypatch):
    model = make_invariant(_load_reward(reward_paths["llama"]))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(reward_paths["llama"])
    monkeypatch.setattr("invariant_infer.model.layer_forwards.linear", BATCH_BLOCKED_LINEAR)
    assert _mismatches(_rewards(model, tokenizer, "left"), TEXTS[:CONTROL_ITEMS]) > 0


def test_negative_control_a_linear_blocked_by_the_batch_size_moves_the_reward(reward_paths, monkeypatch):
    model = make_invariant(_load_reward(reward_paths["qwen3"]))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(reward_paths["qwen3"])
    monkeypatch.setattr("invariant_infer.model.layer_forwards.linear", BATCH_BLOCKED_LINEAR)
    assert _mismatches(_rewards(model, tokenizer, "right"), TEXTS[:CONTROL_ITEMS]) > 0


def _reward_errors(path) -> tuple[float, float]:
    """(invariant fp32, stock fp32) relative errors of one right-padded batch's rewards against float64 stock."""
    batch = PreTrainedTokenizerFast.from_pretrained(path)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = _load_reward(path, torch.float64)(**batch).logits
        stock = _load_reward(path)(**batch).logits
        invariant = make_invariant(_load_reward(path))(**batch).logits
    error = lambda got: ((got.double() - reference).norm() / reference.norm()).item()  # noqa: E731
    return error(invariant), error(stock)


def test_reward_within_twice_stock_fp32_error_of_float64(reward_paths):
    invariant, stock = _reward_errors(reward_paths["qwen3"])
    assert 0 < invariant <= 2 * stock, (invariant, stock)


@pytest.mark.heavy
def test_llama_reward_within_the_fp32_tolerance_of_float64(reward_paths):
    invariant, stock = _reward_errors(reward_paths["llama"])
    assert 0 < invariant <= FP32_RELATIVE_TOLERANCE and stock <= FP32_RELATIVE_TOLERANCE, (invariant, stock)


def test_reward_model_audits_clean(reward_paths):
    """Every float reduction of the patched reward model's forward, its score head and last-token pick
    included, runs on the invariant kernels."""
    report = audit(make_invariant(_load_reward(reward_paths["qwen3"])))
    assert report.ok, report.stray


def test_cross_encoder_predict_is_bitwise_alone_at_any_batch_size_and_restores(reward_paths):
    model = st.CrossEncoder(str(reward_paths["qwen3"]), device="cpu")
    stock_activation = model.activation_fn
    assert type(stock_activation) is torch.nn.Sigmoid  # one label: sigmoid scores, which run as a kernel
    assert make_invariant(model) is model and is_invariant(model[0].auto_model)
    predict = lambda pairs, b: model.predict(pairs, batch_size=b, convert_to_tensor=True)  # noqa: E731
    assert _mismatches(predict, PAIRS) == 0
    restore(model)
    assert model.activation_fn is stock_activation and not is_invariant(model[0].auto_model)


def test_logit_score_cross_encoder_is_bitwise_alone_at_any_batch_size(qwen3_base, tmp_path):
    """A CrossEncoder over a causal LM scoring a pair by its last token's yes - no logits (Qwen3-Reranker's
    layout; left padding), saved and loaded back."""
    transformer = Transformer(str(qwen3_base), transformer_task="text-generation")
    st.CrossEncoder(modules=[transformer, LogitScore(true_token_id=5, false_token_id=6)], device="cpu").save(
        str(tmp_path))
    model = make_invariant(st.CrossEncoder(str(tmp_path), device="cpu"))
    assert model[0].tokenizer.padding_side == "left" and is_invariant(model[0].auto_model)
    predict = lambda pairs, b: model.predict(pairs, batch_size=b, convert_to_tensor=True)  # noqa: E731
    assert _mismatches(predict, PAIRS) == 0


# ---- encoders: BERT and XLM-R embedders, cross-encoders over their one-label heads ------------------------

# sentence-transformers embedders on an encoder base model, normalised: name -> (family, pooling mode)
ENCODER_EMBEDDERS = {"bert-mean": ("bert", "mean"), "xlm-roberta-cls": ("xlm-roberta", "cls")}
ENCODER_TOKENIZERS = {"bert": save_wordpiece_tokenizer, "xlm-roberta": save_roberta_tokenizer}
ENCODER_KINDS = [*ENCODER_EMBEDDERS, *(f"{family}-cross-encoder" for family in ENCODER_TOKENIZERS)]


@pytest.fixture(scope="module")
def encoder_paths(tmp_path_factory):
    """{name: path} of ``ENCODER_KINDS``, saved by sentence-transformers: the embedders and a CrossEncoder
    over each family's one-label ``ForSequenceClassification`` (a reranker)."""
    root = tmp_path_factory.mktemp("encoder_pooled")
    for family, save_tokenizer in ENCODER_TOKENIZERS.items():
        for head, auto_class, labels in (("base", AutoModel, {}), ("head", AutoModelForSequenceClassification,
                                                                    {"num_labels": 1})):
            config = random_config(family, "tiny", **ONE_LAYER, **labels)
            save_tokenizer(save_random_checkpoint(root / f"{family}-{head}", config, auto_class=auto_class))
    paths = {}
    for name, (family, mode) in ENCODER_EMBEDDERS.items():
        transformer = Transformer(str(root / f"{family}-base"))
        model = st.SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), mode),
                                                Normalize()], device="cpu")
        paths[name] = root / name
        model.save(str(paths[name]))
    for family in ENCODER_TOKENIZERS:
        paths[f"{family}-cross-encoder"] = root / f"{family}-cross-encoder"
        st.CrossEncoder(str(root / f"{family}-head"), device="cpu").save(str(paths[f"{family}-cross-encoder"]))
    return paths


def _load_encoder_kind(path, name, dtype=torch.float32):
    if name.endswith("cross-encoder"):
        return st.CrossEncoder(str(path), device="cpu", model_kwargs={"dtype": dtype})
    return _load_embedder(path, dtype)


def _items_and_run(model):
    """(the inputs, run(inputs, batch_size) -> outputs): texts to encode, or pairs to predict, as logits (a
    random head's scores sit near 0, where the sigmoid's rounding can hide a logit's last bits)."""
    if isinstance(model, st.CrossEncoder):
        return PAIRS, lambda pairs, b: model.predict(pairs, batch_size=b, activation_fn=torch.nn.Identity(),
                                                     convert_to_tensor=True)
    return TEXTS, _encode(model)


@pytest.mark.fast_cells(ids=["xlm-roberta-cls-fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ENCODER_KINDS)
def test_encoder_outputs_are_bitwise_alone_at_any_batch_size_order_and_padding_side(encoder_paths, name, dtype):
    model = _load_encoder_kind(encoder_paths[name], name, dtype)
    assert make_invariant(model) is model and is_invariant(model[0].auto_model)
    items, run = _items_and_run(model)
    alone = _alone(run, items)
    for side in ("right", "left"):
        model[0].tokenizer.padding_side = side
        assert _pads_on(model[0].tokenizer, side)
        assert _mismatches(run, items, alone) == 0, side


@pytest.mark.heavy
@pytest.mark.parametrize("name", ENCODER_KINDS)
def test_negative_control_a_linear_blocked_by_the_batch_size_moves_encoder_outputs(encoder_paths, name,
                                                                                     monkeypatch):
    """BLOCK_K by M, up to 24 rows or more: each of the three items alone (at most 16 tokens) reduces its
    projections in other K blocks than any batch of them (30 rows or more)."""
    monkeypatch.setattr("invariant_infer.model.layer_forwards.linear",
                        functools.partial(m_dependent_linear, small_m=24))
    model = make_invariant(_load_encoder_kind(encoder_paths[name], name))
    items, run = _items_and_run(model)
    assert _mismatches(run, items[:CONTROL_ITEMS]) > 0


@pytest.mark.heavy
@pytest.mark.parametrize("name", ENCODER_KINDS)
def test_encoder_outputs_within_the_fp32_tolerance_of_float64(encoder_paths, name):
    """Embeddings (pooled and normalised by sentence-transformers' modules in float64) and cross-encoder
    logits of one right-padded batch: the invariant fp32 model within ``FP32_RELATIVE_TOLERANCE`` of float64
    stock, as stock fp32 is."""
    def outputs(model):
        items, run = _items_and_run(model)
        return run(items, len(items)).double()
    reference = outputs(_load_encoder_kind(encoder_paths[name], name, torch.float64))
    stock = outputs(_load_encoder_kind(encoder_paths[name], name))
    invariant = outputs(make_invariant(_load_encoder_kind(encoder_paths[name], name)))
    error = lambda got: ((got - reference).norm() / reference.norm()).item()  # noqa: E731
    assert 0 < error(invariant) <= FP32_RELATIVE_TOLERANCE and error(stock) <= FP32_RELATIVE_TOLERANCE, (
        error(invariant), error(stock))
