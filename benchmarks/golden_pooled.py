"""Golden digests of the pooled kinds, part of ``benchmarks.golden_digests``: a BERT embedder (first-token
pooling, normalised), an XLM-R cross-encoder (one relevance logit), a Qwen3 last-token embedder
(normalised), a Qwen3 reward model (one logit) and a ModernBERT embedder (mean pooling, normalised; a
global and a sliding-window layer). Each is one layer whose weights and token ids come from
the golden formula, written with ``save_pretrained``, read back with ``from_pretrained``, made invariant and
run as ``PooledModel`` runs it (``forward_rows``, then ``embeddings`` for the embedders).

Per kind and dtype: ``alone`` (each row alone), ``left_pad`` and ``right_pad`` (the rows in one padded batch,
reordered), each the digest of the rows' float32 outputs in row order: equal by design.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import (AutoModel, AutoModelForSequenceClassification, BertConfig, ModernBertConfig, Qwen3Config,
                          XLMRobertaConfig)

from benchmarks.golden_formula import digest, integers, parameter_values
from invariant_infer.model.patch import make_invariant
from invariant_infer.model.pooled_model import PooledInput, PooledModel

_ENCODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1, vocab_size=256,
                layer_norm_eps=1e-12, hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                position_embedding_type="absolute", classifier_dropout=None)
_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
              vocab_size=256, max_position_embeddings=128, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attention_bias=False, pad_token_id=0)
# Two layers: a global one and a local one whose window (8 tokens, 4 on each side) is shorter than the
# 11-token sample, so the window shapes the bits.
_MODERNBERT = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=256,
                   max_position_embeddings=128, global_attn_every_n_layers=2, local_attention=8, norm_eps=1e-5,
                   norm_bias=False, attention_bias=False, mlp_bias=False, hidden_activation="gelu",
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   pad_token_id=0, bos_token_id=2, eos_token_id=1, cls_token_id=2, sep_token_id=1,
                   embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0)
# kind -> (config class, every field that shapes the arithmetic, task, pooling mode, token types)
POOLED_CONFIGS = {
    "bert_embedding": (BertConfig, dict(_ENCODER, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0),
                       "embed", "cls", True),
    "xlm_roberta_score": (XLMRobertaConfig, dict(_ENCODER, max_position_embeddings=130, type_vocab_size=1,
                                                 pad_token_id=1, num_labels=1), "score", None, False),
    "qwen3_lasttoken_embedding": (Qwen3Config, _QWEN3, "embed", "lasttoken", False),
    "qwen3_reward": (Qwen3Config, dict(_QWEN3, num_labels=1), "reward", None, False),
    # mean pooling, normalised: as ModernBERT embedders ship (sentence-transformers' Pooling "mean", Normalize)
    "modernbert_embedding": (ModernBertConfig, _MODERNBERT, "embed", "mean", False),
}
SAMPLE_LENGTHS = (6, 1, 11, 3)
# name -> (members in batch order, padding side)
BATCHINGS = {"left_pad": ((0, 1, 2, 3), "left"), "right_pad": ((3, 2, 1, 0), "right")}


def write_checkpoint(kind: str, dtype: torch.dtype, path: Path) -> Path:
    config_class, fields, task, _, _ = POOLED_CONFIGS[kind]
    auto_class = AutoModel if task == "embed" else AutoModelForSequenceClassification
    model = auto_class.from_config(config_class(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(parameter_values(name, tuple(param.shape)))
    model.to(dtype).save_pretrained(path)
    return path


def samples(kind: str) -> list[PooledInput]:
    """Token ids above the special ids (0 .. 2); token types 0 then 1 (a pair) where the kind has them."""
    _, fields, _, _, types = POOLED_CONFIGS[kind]
    rows = []
    for i, n in enumerate(SAMPLE_LENGTHS):
        ids = integers(f"{kind}/sample{i}", n, 3, fields["vocab_size"]).tolist()
        rows.append(PooledInput(ids, [0] * ((n + 1) // 2) + [1] * (n // 2) if types else None))
    return rows


@torch.no_grad()
def pooled_digests(kind: str, dtype_name: str, dtype: torch.dtype, device: str, path: Path) -> dict[str, str]:
    """{kind/dtype/case: sha256 hex} of the cases in the module's docstring."""
    config_class, fields, task, mode, types = POOLED_CONFIGS[kind]
    write_checkpoint(kind, dtype, path)
    auto_class = AutoModel if task == "embed" else AutoModelForSequenceClassification
    model = make_invariant(auto_class.from_pretrained(path, dtype=dtype).to(device).eval())
    names = ["input_ids", "token_type_ids", "attention_mask"] if types else ["input_ids", "attention_mask"]
    rows, prefix = samples(kind), f"{kind}/{dtype_name}"

    def outputs(members, side) -> list[torch.Tensor]:
        pooled = PooledModel(model, SimpleNamespace(model_input_names=names), task, pooling_mode=mode,
                             normalize=task == "embed", labels=["LABEL_0"], max_length=128,
                             dimensions=fields["hidden_size"] if task == "embed" else 1,
                             pad_token_id=fields["pad_token_id"], padding_side=side)
        out = pooled.forward_rows([rows[m] for m in members])
        return list(pooled.embeddings(out) if task == "embed" else out)
    out = {f"{prefix}/alone": digest(outputs([m], "right")[0] for m in range(len(rows)))}
    for name, (members, side) in BATCHINGS.items():
        by_row = dict(zip(members, outputs(members, side)))
        out[f"{prefix}/{name}"] = digest(by_row[m] for m in sorted(by_row))
    return out
