"""BERT encoders (``BertModel``, ``BertForSequenceClassification``: bge / MiniLM embedders, cross-encoder
rerankers): absolute position embeddings counted from 0, token type embeddings, the pooler (dense +
tanh on the first token) under the classifier."""
from transformers import BertConfig
from transformers.models.bert.modeling_bert import (BertForSequenceClassification, BertIntermediate, BertLayer,
                                                    BertModel, BertPooler, BertSelfAttention)

from .encoder_adapter import EncoderAdapter, refuse_encoder_config, register_encoder_family

ADAPTER = register_encoder_family(EncoderAdapter(
    model_type="bert", config_class=BertConfig, base=BertModel, layer=BertLayer, self_attention=BertSelfAttention,
    intermediate=BertIntermediate, pooler=BertPooler, architectures=(BertModel, BertForSequenceClassification),
    refuse_config=refuse_encoder_config,
    presets={
        # bert-base-uncased (and the bge-base / e5-base embedders on it).
        "bert-base": dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                          vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                          hidden_act="gelu"),
        # head_dim 16, the exact gelu; two token types, as sentence pairs use them.
        "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                     vocab_size=512, max_position_embeddings=128, type_vocab_size=2, layer_norm_eps=1e-12,
                     hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    },
))
