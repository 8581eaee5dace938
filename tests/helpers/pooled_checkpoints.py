"""Tiny pooled checkpoints saved as users have them: a sentence-transformers embedder on BERT (cls pooling,
Normalize), a Qwen3 last-token embedder (left padding, Normalize; Qwen3-Embedding's layout), an XLM-R
cross-encoder (one label, saved by sentence-transformers' CrossEncoder), a Qwen3 reward model (one label)
and a ModernBERT mean-pooling embedder. One layer (ModernBERT: two), random weights, each with a locally
built tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModel, AutoModelForSequenceClassification, BertTokenizerFast, PreTrainedTokenizerFast

from helpers.tokenizer import BPE_WORDS, train_tokenizer
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

ONE_LAYER = {"num_hidden_layers": 1}
TEXTS = ["the cat runs fast", "a dog", "model token batch score sequence invariant logits prompt", "the",
         "prompt completion cat dog runs fast the a model token", "dog dog", "score", "batch batch the invariant"]
PAIRS = [(TEXTS[i], TEXTS[(i + 3) % len(TEXTS)]) for i in range(len(TEXTS))]
KINDS = ("bert-embedder", "qwen3-embedder", "xlm-roberta-cross-encoder", "qwen3-reward")
# Built only where a (heavy) test asks: a ModernBERT embedder (mean pooling, Normalize, right padding; as
# ModernBERT embedders ship) on the two-layer tiny preset, a global layer and an 8-token window one.
MORE_KINDS = ("modernbert-embedder",)


def save_wordpiece_tokenizer(path: Path) -> None:
    """A BERT WordPiece tokenizer ([CLS] a [SEP] b [SEP], token types) over the test words."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BPE_WORDS, *"abcdefghijklmnopqrstuvwxyz"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path)


def save_roberta_tokenizer(path: Path) -> None:
    """An XLM-R style tokenizer: <s> a </s></s> b </s>, <pad> = 1 (XLM-R's padding_idx), no token types."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + BPE_WORDS)}
    wordlevel = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()
    wordlevel.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordlevel, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>", cls_token="<s>", sep_token="</s>",
                                        model_input_names=["input_ids", "attention_mask"])
    tokenizer.save_pretrained(path)


def save_bpe_tokenizer(path: Path, padding_side: str = "right") -> None:
    """The byte-level BPE of the decoder tests, its pad token the end-of-text token."""
    train_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    tokenizer.save_pretrained(path)


def _sentence_transformer(base: Path, path: Path, mode: str, padding_side: str) -> Path:
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    transformer = Transformer(str(base))
    transformer.tokenizer.padding_side = padding_side
    st.SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), mode), Normalize()],
                           device="cpu").save(str(path))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": padding_side}))
    return path


def save_pooled_checkpoint(kind: str, root: Path, seed: int = 0) -> Path:
    """One of ``KINDS`` or ``MORE_KINDS`` under ``root`` (its own folder); returns the folder users load."""
    root = Path(root)
    if kind == "bert-embedder":
        base = save_random_checkpoint(root / "bert-base", random_config("bert", "tiny", **ONE_LAYER), seed=seed)
        save_wordpiece_tokenizer(base)
        return _sentence_transformer(base, root / kind, "cls", "right")
    if kind == "qwen3-embedder":
        base = save_random_checkpoint(root / "qwen3-base", random_config("qwen3", "tiny", **ONE_LAYER), seed=seed,
                                      auto_class=AutoModel)
        save_bpe_tokenizer(base, "left")
        return _sentence_transformer(base, root / kind, "lasttoken", "left")
    if kind == "xlm-roberta-cross-encoder":
        import sentence_transformers as st
        head = root / "xlm-roberta-head"
        save_random_checkpoint(head, random_config("xlm-roberta", "tiny", num_labels=1, vocab_size=64, **ONE_LAYER),
                               seed=seed, auto_class=AutoModelForSequenceClassification)
        save_roberta_tokenizer(head)
        st.CrossEncoder(str(head), device="cpu").save(str(root / kind))
        return root / kind
    if kind == "qwen3-reward":
        path = root / kind
        save_bpe_tokenizer(path)
        pad = PreTrainedTokenizerFast.from_pretrained(path).pad_token_id
        config = random_config("qwen3", "tiny", num_labels=1, pad_token_id=pad, **ONE_LAYER)
        return save_random_checkpoint(path, config, seed=seed, auto_class=AutoModelForSequenceClassification)
    if kind == "modernbert-embedder":
        base = save_random_checkpoint(root / "modernbert-base", random_config("modernbert", "tiny"), seed=seed,
                                      auto_class=AutoModel)
        save_bpe_tokenizer(base)
        return _sentence_transformer(base, root / kind, "mean", "right")
    raise ValueError(f"unknown pooled checkpoint kind {kind!r}; kinds: {KINDS + MORE_KINDS}")
