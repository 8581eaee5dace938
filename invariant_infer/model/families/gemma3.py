"""Gemma 3 (the text model, ``gemma3_text``: Gemma-3-1B, and the language model of the larger,
multimodal checkpoints): sliding-window layers (``layer_types``) beside global ones, each type with
its own RoPE base; four (1 + w) RMSNorms per layer, computed in fp32, and per-head q/k norms; the
embeddings scaled by sqrt(hidden) (transformers' own module, an exact multiply); attention scaled by
``query_pre_attn_scalar`` ** -0.5; the gelu_tanh MLP. Logit softcapping (Gemma 2's) and
bidirectional attention are refused by name (the support table, ``invariant_infer.model.support``)."""
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm

from . import FamilyAdapter, register_family


ADAPTER = register_family(FamilyAdapter(
    model_type="gemma3_text", config_class=Gemma3TextConfig, rms_norm=Gemma3RMSNorm, mlp=Gemma3MLP,
    head_norms=("q_norm", "k_norm"), zero_centred_norms=True, mlp_activation="gelu_tanh",
    presets={
        # google/gemma-3-27b-it's text_config (config.json): 62 layers, five sliding (a window of 1024
        # keys) then one global; 32 query heads sharing 16 KV heads of 128; the global layers' RoPE
        # linearly scaled by 8.
        "gemma-3-27b": dict(hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
                            head_dim=128, num_hidden_layers=62, sliding_window=1024, query_pre_attn_scalar=168,
                            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                         for i in range(62)],
                            vocab_size=262208, max_position_embeddings=131072, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1000000.0}}),
        # 2 layers: one sliding (a window of 24 keys), one global, as the released models interleave
        # five and one; 4 query heads sharing 1 KV head of 32; local and global RoPE bases as released.
        "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
                     head_dim=32, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                     sliding_window=24, query_pre_attn_scalar=32, vocab_size=512, max_position_embeddings=512,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    },
))
