"""XLM-RoBERTa encoders (``XLMRobertaModel``, ``XLMRobertaForSequenceClassification``: bge-m3, the
bge-reranker cross-encoders): position ids counted from ``padding_idx`` + 1 (pads at ``padding_idx``), and
a classification head of its own (dense, tanh, out_proj on the first token)."""
from transformers import XLMRobertaConfig
from transformers.models.xlm_roberta.modeling_xlm_roberta import (XLMRobertaClassificationHead,
                                                                  XLMRobertaForSequenceClassification,
                                                                  XLMRobertaIntermediate, XLMRobertaLayer,
                                                                  XLMRobertaModel, XLMRobertaPooler,
                                                                  XLMRobertaSelfAttention)

from .encoder_adapter import EncoderAdapter, refuse_encoder_config, register_encoder_family

ADAPTER = register_encoder_family(EncoderAdapter(
    model_type="xlm-roberta", config_class=XLMRobertaConfig, base=XLMRobertaModel, layer=XLMRobertaLayer,
    self_attention=XLMRobertaSelfAttention, intermediate=XLMRobertaIntermediate, pooler=XLMRobertaPooler,
    architectures=(XLMRobertaModel, XLMRobertaForSequenceClassification),
    classification_head=XLMRobertaClassificationHead, positions_after_padding_idx=True,
    refuse_config=refuse_encoder_config,
    presets={
        # xlm-roberta-base (bge-reranker-base): BERT-base widths, a 250002-token vocabulary, 514 positions
        # (512 tokens after padding_idx 1).
        "xlm-roberta-base": dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                 num_hidden_layers=12, vocab_size=250002, max_position_embeddings=514,
                                 type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu", pad_token_id=1,
                                 bos_token_id=0, eos_token_id=2),
        "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                     vocab_size=512, max_position_embeddings=130, type_vocab_size=1, layer_norm_eps=1e-5,
                     hidden_act="gelu", pad_token_id=1, bos_token_id=0, eos_token_id=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0),
    },
))
