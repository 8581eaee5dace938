"""Checkpoints of architectures the commands do not run, saved with ``save_pretrained`` as users
have them: a supported family's sequence-classification head, and an encoder of another family."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM, Qwen3Config, Qwen3ForSequenceClassification

from invariant_infer.testing.random_checkpoints import random_config


def save_sequence_classification_checkpoint(path: Path) -> Path:
    """A tiny ``Qwen3ForSequenceClassification`` (model_type qwen3, a supported family)."""
    torch.manual_seed(0)
    config = Qwen3Config(**{**random_config("qwen3", "tiny", num_hidden_layers=1).to_dict(), "num_labels": 2})
    Qwen3ForSequenceClassification(config).save_pretrained(path)
    return path


def save_encoder_checkpoint(path: Path) -> Path:
    """A tiny ``BertForMaskedLM`` (model_type bert)."""
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=128)
    BertForMaskedLM(config).save_pretrained(path)
    return path
