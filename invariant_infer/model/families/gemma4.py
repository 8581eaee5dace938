"""Gemma 4's text model (``gemma4_text``: ``Gemma4ForCausalLM``), dense. What it adds to Gemma 3:

* global layers with their own head_dim (``global_head_dim``) and KV heads (``num_global_key_value_heads``),
  read from ``config.per_layer_config[layer]``, and with ``attention_k_eq_v`` no v_proj (V is the raw
  k projection, then v_norm); their RoPE is ``proportional`` (a ``partial_rotary_factor`` of the
  frequencies, the others 0: cos 1, sin 0), a static table like any other;
* KV sharing: the last ``num_kv_shared_layers`` layers own no k/v projections and attend over the K/V
  the last earlier layer of their type computed (``cache_specs.SharedKVSpec``);
* per-layer input embeddings (``hidden_size_per_layer_input``): a second embedding table and a
  projection of the embeddings give each layer a row it gates in after its MLP
  (gelu_tanh(gate(h)) * per_layer_input, the ``gelu_tanh_mul`` kernel: ``model.gemma4``);
* plain (weight, not 1 + weight) RMSNorms computed in fp32, v_norm without a weight, a per-layer scalar
  (a multiply), attention scaled by 1.0, and final logit softcapping: cap * tanh(logits / cap) on the
  invariant lm_head's logits, each element alone (the ``tanh`` kernel).

The MoE variant (``enable_moe_block``, 26B-A4B): experts beside each layer's dense MLP, their own
router (``model.gemma4_moe``); quantized or replaced experts are refused by layer name before anything
is patched (``check_layer``). Refused by name: bidirectional attention. The released checkpoints
(``Gemma4ForConditionalGeneration``, model type ``gemma4``) run their text model through this adapter
(``families.gemma4_multimodal``)."""
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import (Gemma4ForCausalLM, Gemma4RMSNorm, Gemma4TextDecoderLayer,
                                                        Gemma4TextMLP)

from ..gemma4 import causal_lm_forward, decoder_layer_forward
from ..gemma4_moe import check_layer
from . import FamilyAdapter, register_family


def _refuse(config) -> str | None:
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return f"only the gelu_pytorch_tanh MLP is supported, config.hidden_activation={config.hidden_activation!r}"
    return None


def _sliding_then_global(layers: int, every: int = 6) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]


ADAPTER = register_family(FamilyAdapter(
    model_type="gemma4_text", config_class=Gemma4TextConfig, rms_norm=Gemma4RMSNorm, mlp=Gemma4TextMLP,
    head_norms=("q_norm",), optional_projections=("k_proj", "v_proj"), norms_scaled_in_fp32=True,
    mlp_activation="gelu_tanh", refuse_config=_refuse, final_logit_softcapping=True,
    module_forwards={Gemma4TextDecoderLayer: decoder_layer_forward, Gemma4ForCausalLM: causal_lm_forward},
    check_layer=check_layer,
    presets={
        # Gemma 4 31B (dense) text model. transformers ships no config for it (its defaults are
        # gemma-4-e2b's); these numbers are the published checkpoint's as a public model card of a port
        # of google/gemma-4-31B-it states them (huggingface.co/mlboydaisuke/Gemma-4-31B-CoreAI): 60 layers,
        # five sliding (1024 keys) then one global; 32 query heads; sliding layers 16 KV heads of 256,
        # global layers 4 KV heads of 512 with K = V; no per-layer inputs, no KV sharing; vocab 262144;
        # final logits softcapped at 30; tied embeddings. The MLP width 21504 is from apxml.com/models/gemma-4-31b.
        # RoPE: transformers' defaults for Gemma 4 (sliding 10k; global proportional, 1/4 of the
        # frequencies, base 1M).
        "gemma-4-31b": dict(hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
                            head_dim=256, global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
                            num_hidden_layers=60, layer_types=_sliding_then_global(60), sliding_window=1024,
                            vocab_size=262144, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                            final_logit_softcapping=30.0, max_position_embeddings=262144, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
        # Gemma 4 26B-A4B (MoE) text model: the numbers of the published config of google/gemma-4-26B-A4B as
        # public ports and config parsers reproduce it. 30 layers, five sliding (1024 keys) then one global;
        # 16 query heads; sliding layers 8 KV heads of 256, global layers 2 KV heads of 512 with K = V; a
        # dense MLP of 2112 beside 128 experts of 704, top-8; no per-layer inputs, no KV sharing; vocab
        # 262144; final logits softcapped at 30; tied embeddings; RoPE as the 31B's. Built on the meta device:
        # 25.2B parameters, 3.8B of them per token (8 of 128 experts), the name's 26B and A4B.
        "gemma-4-26b-a4b": dict(hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
                                attention_k_eq_v=True, num_hidden_layers=30, layer_types=_sliding_then_global(30),
                                sliding_window=1024, enable_moe_block=True, num_experts=128, top_k_experts=8,
                                moe_intermediate_size=704, use_double_wide_mlp=False, vocab_size=262144,
                                hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=30.0,
                                max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                hidden_activation="gelu_pytorch_tanh",
                                rope_parameters={"full_attention": {"rope_type": "proportional",
                                                                    "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        # 4 layers, every feature at once: sliding (16 keys), global, sliding, global; the last two reuse
        # the K/V of the first two (num_kv_shared_layers=2) and have the double-wide MLP; sliding layers
        # 2 KV heads of 16, global layers 1 KV head of 32 with K = V (so both kinds keep 64 values of K
        # and V per token, in different shapes); per-layer inputs of 8; logits softcapped at 5 (random
        # weights give logits of a few units, which a cap of 30 would barely touch).
        "tiny": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=4,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                     sliding_window=16, num_kv_shared_layers=2, use_double_wide_mlp=True, vocab_size=512,
                     vocab_size_per_layer_input=512, hidden_size_per_layer_input=8, final_logit_softcapping=5.0,
                     max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     hidden_activation="gelu_pytorch_tanh"),
        # The tiny preset's features with the MoE block in every layer: 8 experts of width 32, top-2.
        "tiny-moe": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                         num_hidden_layers=4, layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention", "full_attention"],
                         sliding_window=16, num_kv_shared_layers=2, use_double_wide_mlp=True, vocab_size=512,
                         vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
                         final_logit_softcapping=5.0, max_position_embeddings=512, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", enable_moe_block=True,
                         num_experts=8, top_k_experts=2, moe_intermediate_size=32),
    },
))
