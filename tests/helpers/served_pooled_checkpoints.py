"""Tiny pooled checkpoints saved as users have them: a BERT sentence-transformers embedder (mean pooling,
normalised), a BERT cross-encoder (one label), a Qwen3 reward model (one label) and a Qwen3 classifier
(three labels); one layer each, with a WordPiece (BERT) or byte-level BPE (Qwen3) tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, BertTokenizerFast, PreTrainedTokenizerFast

from helpers.tokenizer import BPE_WORDS, train_tokenizer
from invariant_infer.testing.random_checkpoints import random_config

BERT_MAX_LENGTH = 64
MATRYOSHKA = (16, 32)
CLASS_LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def save_bert_tokenizer(path: Path) -> BertTokenizerFast:
    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BPE_WORDS, *"abcdefghijklmnopqrstuvwxyz,.!?"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"), model_max_length=BERT_MAX_LENGTH)
    tokenizer.save_pretrained(path)
    return tokenizer


def _bert_config(tokenizer, **extra):
    return random_config("bert", "tiny", num_hidden_layers=1, vocab_size=len(tokenizer),
                         max_position_embeddings=BERT_MAX_LENGTH, pad_token_id=tokenizer.pad_token_id, **extra)


def save_bert_embedder(path: Path) -> Path:
    """A sentence-transformers folder: BERT, mean pooling, Normalize; Matryoshka (``MATRYOSHKA``)."""
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoModel

    base = path.parent / f"{path.name}-base"
    tokenizer = save_bert_tokenizer(base)
    torch.manual_seed(1)
    AutoModel.from_config(_bert_config(tokenizer, matryoshka_dimensions=list(MATRYOSHKA))).save_pretrained(base)
    transformer = Transformer(str(base))
    model = st.SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean"),
                                            Normalize()], device="cpu")
    model.save(str(path))
    return path


def save_bert_cross_encoder(path: Path) -> Path:
    tokenizer = save_bert_tokenizer(path)
    torch.manual_seed(2)
    AutoModelForSequenceClassification.from_config(_bert_config(tokenizer, num_labels=1)).save_pretrained(path)
    return path


def save_qwen3_head(path: Path, num_labels: int) -> Path:
    """A Qwen3ForSequenceClassification: a reward model (one label) or a classifier (``CLASS_LABELS``)."""
    path.mkdir(parents=True, exist_ok=True)
    train_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    labels = {} if num_labels == 1 else {"id2label": CLASS_LABELS, "label2id": {v: k for k, v in CLASS_LABELS.items()}}
    config = random_config("qwen3", "tiny", num_hidden_layers=1, num_labels=num_labels,
                           pad_token_id=tokenizer.pad_token_id, **labels)
    torch.manual_seed(3 + num_labels)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return path
