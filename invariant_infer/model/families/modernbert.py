"""ModernBERT encoders (``ModernBertModel``, ``ModernBertForSequenceClassification``: ModernBERT embedders
and rerankers): rotary positions (one theta for global layers, another for local ones), every
``global_attn_every_n_layers``-th layer global and the others a bidirectional sliding window, bias-free
LayerNorms, a GeGLU MLP, and a classification head (dense, activation, norm) on the first token or the
mean of the real tokens. Its layout is not BERT's: ``invariant_infer.model.modernbert`` patches it."""
from transformers import ModernBertConfig
from transformers.models.modernbert.modeling_modernbert import (ModernBertAttention, ModernBertEncoderLayer,
                                                                ModernBertForSequenceClassification, ModernBertMLP,
                                                                ModernBertModel, ModernBertPredictionHead)

from .encoder_adapter import GELU_FORMS, EncoderAdapter, register_encoder_family

POOLINGS = ("cls", "mean")


def refuse_modernbert_config(config) -> str | None:
    """What the ModernBERT forwards do not compute exactly: other activations, poolings, rope scalings."""
    for name in ("hidden_activation", "classifier_activation"):
        if getattr(config, name) not in GELU_FORMS:
            return f"{name} {getattr(config, name)!r} is not supported; supported: {sorted(GELU_FORMS)}"
    if config.classifier_pooling not in POOLINGS:
        return f"classifier_pooling {config.classifier_pooling!r} is not supported; supported: {list(POOLINGS)}"
    if set(config.layer_types) - {"full_attention", "sliding_attention"}:
        return f"layer_types {sorted(set(config.layer_types))} hold a type other than full / sliding attention"
    for layer_type, params in (config.rope_parameters or {}).items():
        if params is not None and params.get("rope_type", "default") != "default":
            return (f"rope_type {params['rope_type']!r} on {layer_type} layers is not supported; only the default "
                    "rotary embedding is (its cos/sin table is fixed per position)")
    return None


ADAPTER = register_encoder_family(EncoderAdapter(
    model_type="modernbert", config_class=ModernBertConfig, base=ModernBertModel, layer=ModernBertEncoderLayer,
    self_attention=ModernBertAttention, intermediate=ModernBertMLP, pooler=ModernBertPredictionHead,
    architectures=(ModernBertModel, ModernBertForSequenceClassification), layout="modernbert",
    refuse_config=refuse_modernbert_config,
    presets={
        # ModernBERT-base: 22 layers, every third global (rope theta 160000), the others a window of 128
        # tokens (64 on each side, theta 10000), 8192 positions.
        "modernbert-base": dict(hidden_size=768, intermediate_size=1152, num_attention_heads=12, num_hidden_layers=22,
                                vocab_size=50368, max_position_embeddings=8192, global_attn_every_n_layers=3,
                                local_attention=128, norm_eps=1e-5, hidden_activation="gelu", pad_token_id=50283,
                                bos_token_id=50281, eos_token_id=50282, cls_token_id=50281, sep_token_id=50282),
        # head_dim 16; layer 0 global, layer 1 local with a window of 8 tokens (4 on each side), so windows
        # matter on short texts.
        "tiny": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2,
                     vocab_size=512, max_position_embeddings=128, global_attn_every_n_layers=2, local_attention=8,
                     norm_eps=1e-5, hidden_activation="gelu", pad_token_id=0, bos_token_id=2, eos_token_id=1,
                     cls_token_id=2, sep_token_id=1, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0,
                     classifier_dropout=0.0),
    },
))
