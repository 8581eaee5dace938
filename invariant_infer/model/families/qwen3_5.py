"""Qwen3.5 (the text model, ``qwen3_5_text``, also as ``AutoModelForCausalLM`` loads a ``qwen3_5``
checkpoint): Gated DeltaNet layers (``linear_attn``) interleaved with gated full attention
(``self_attn``: a doubled q_proj whose second half gates the output through sigmoid, zero-centred
RMSNorm on each query and key head, partial rotary), zero-centred RMSNorms (fp32 x (1 + w)), the
silu MLP."""
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5Attention, Qwen3_5GatedDeltaNet, Qwen3_5MLP,
                                                          Qwen3_5RMSNorm)

from . import FamilyAdapter, LinearAttentionLayout, register_family

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen3_5_text", config_class=Qwen3_5TextConfig, rms_norm=Qwen3_5RMSNorm, mlp=Qwen3_5MLP,
    head_norms=("q_norm", "k_norm"),
    row_parallel=("self_attn.o_proj", "mlp.down_proj", "linear_attn.out_proj"),
    linear_attention=LinearAttentionLayout(Qwen3_5GatedDeltaNet), gated_attention=Qwen3_5Attention,
    zero_centred_norms=True,
    presets={
        # 2 layers: one Gated DeltaNet, one gated full attention (the released models repeat three of
        # the first and one of the second); 2 key heads of 16 and 4 value heads of 32 in the linear
        # layers; head_dim 32 with a quarter of it rotary, as the released models.
        "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=512,
                     max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    },
))
