"""The kernel variants the supported families reach on a GPU, recorded on CPU at real widths.

Each workload builds a model of a released model's widths (one or two layers: each layer of a model
launches the variants of every other of its kind), patches it, and runs one path of it under
``recorded_launches``: the forward (a padded batch of short rows, and one long row so that linear's
per-shape configs take both their chunk schedules), the backward of ``token_logprobs`` (training),
the engine (paged attention, the KV writes, sampling) and LoRA (PEFT's layers and the engine's
adapter slots), and every quantized format on a quantized checkpoint. Launches are recorded with
the CUDA tiles, not run (``invariant_infer.kernels.launch_recording``), so nothing here computes
a meaningful value: weights are left uninitialised (``no_init_weights``: a real width costs its
address space, not its memory), and the quantized checkpoints, written for real, keep the
vocabulary small (their embedding and lm_head stay dense and are recorded at real widths in the
dense workloads).

``record_variants(names)`` runs the named workloads (default: all) and returns
``{variant: [workload, ...]}``: what the offline compile gate compiles for each GPU architecture.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..kernels.launch_recording import paused_recording, recorded_launches
from ..model.families import FAMILIES, is_vision_language
from ..model.patch import make_invariant

DTYPE = torch.bfloat16

_QWEN25_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, rms_norm_eps=1e-6, tie_word_embeddings=False)
# Released widths (one or two layers), by model: (family, config fields).
MODELS: dict[str, tuple[str, dict]] = {
    "qwen2.5-1.5b": ("qwen2", {**FAMILIES["qwen2"].presets["qwen2.5-1.5b"], "num_hidden_layers": 1}),
    "qwen2.5-7b": ("qwen2", dict(_QWEN25_7B_TEXT, num_hidden_layers=1, max_position_embeddings=32768,
                                 rope_theta=1000000.0, use_sliding_window=False)),
    "llama-3.1-8b": ("llama", {**FAMILIES["llama"].presets["llama-3.1-8b"], "num_hidden_layers": 1}),
    # a sliding-window layer and a full one, as the released model alternates them; attention sinks
    "gpt-oss-20b": ("gpt_oss", {**FAMILIES["gpt_oss"].presets["gpt-oss-20b"], "num_hidden_layers": 2,
                                "layer_types": ["sliding_attention", "full_attention"]}),
    # Qwen3.5-9B: a Gated DeltaNet layer (16 key heads, 32 value heads of 128) and a gated full-attention one
    "qwen3.5-9b": ("qwen3_5_text", dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=256, num_hidden_layers=2,
                                   layer_types=["linear_attention", "full_attention"], linear_num_key_heads=16,
                                   linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                                   linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=262144,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                    "partial_rotary_factor": 0.25})),
    # the language model's layer and two vision blocks: one over windows, one over the whole image
    "qwen2.5-vl-7b": ("qwen2_5_vl", dict(
        text_config=dict(_QWEN25_7B_TEXT, num_hidden_layers=1, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=2, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1], hidden_act="silu"),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, tie_word_embeddings=False)),
    # Qwen3-VL-2B: its language model's layer and two vision blocks (deepstack from the first)
    "qwen3-vl-2b": ("qwen3_vl", {**FAMILIES["qwen3_vl"].presets["qwen3-vl-2b"],
                                 "text_config": {**FAMILIES["qwen3_vl"].presets["qwen3-vl-2b"]["text_config"],
                                                 "num_hidden_layers": 1},
                                 "vision_config": {**FAMILIES["qwen3_vl"].presets["qwen3-vl-2b"]["vision_config"],
                                                   "depth": 2, "deepstack_visual_indexes": [0]}}),
    # Gemma-3-4B's text widths: a sliding-window layer and a global one, gelu_tanh MLP
    "gemma-3-4b": ("gemma3_text", dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                                       num_key_value_heads=4, head_dim=256, num_hidden_layers=2,
                                       layer_types=["sliding_attention", "full_attention"], sliding_window=1024,
                                       query_pre_attn_scalar=256, vocab_size=262208, max_position_embeddings=131072,
                                       rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       hidden_activation="gelu_pytorch_tanh",
                                       rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0},
                                                        "full_attention": {"rope_type": "default",
                                                                           "rope_theta": 1000000.0}})),
    # Qwen3-30B-A3B's widths with 8 of its 128 experts (a variant does not depend on the expert count)
    "qwen3-30b-a3b": ("qwen3_moe", {**FAMILIES["qwen3_moe"].presets["qwen3-30b-a3b"], "num_hidden_layers": 1,
                                    "num_experts": 8}),
    # DeepSeek-V3's widths: a dense layer and a sparse one with 16 of its 256 experts (2 in each of its 8
    # groups); the absorbed latent attention's head dim 512 + 64
    "deepseek-v3": ("deepseek_v3", {**FAMILIES["deepseek_v3"].presets["deepseek-v3"], "num_hidden_layers": 2,
                                    "first_k_dense_replace": 1, "n_routed_experts": 16}),
    # GLM-4.5-Air's dense first layer and a sparse one, with 8 of its 128 experts (the router's variant at 128
    # experts: tests/kernels/test_moe_group_routing.py compiles it)
    "glm-4.5-air": ("glm4_moe", {**FAMILIES["glm4_moe"].presets["glm-4.5-air"], "num_hidden_layers": 2,
                                 "n_routed_experts": 8}),
}
# Quantized checkpoints: Qwen2.5-1.5B's layer widths, vocabulary cut to this (its lm_head stays dense).
QUANTIZED_VOCAB = 4096
COMPRESSED_TENSORS_SCHEMES = ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM")


def model_config(name: str, **overrides):
    family, fields = MODELS[name]
    adapter = FAMILIES[family]
    return adapter.config_class(**{**fields, **overrides})


def uninitialised_model(name: str, **overrides):
    """The model of ``name``'s widths in bf16, weights allocated but never written, patched."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    config = model_config(name, **overrides)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with paused_recording(), no_init_weights():
        model = auto.from_config(config, dtype=DTYPE).eval()
    return make_invariant(model)


def _rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, left-padded to 7 tokens (the padded path's kernels: key bounds, masked rows)."""
    ids = torch.randint(0, vocab, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask


def _forward(model, vocab: int):
    ids, mask = _rows(vocab)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        # one long row: enough 64-row tiles that each per-shape config runs its K chunks in sequence
        prefill = model(input_ids=torch.randint(0, vocab, (1, 1100)), logits_to_keep=1, use_cache=True)
        # its decode step: few attention tiles over several KV chunks run the chunks in parallel
        model(input_ids=torch.randint(0, vocab, (1, 1)), past_key_values=prefill.past_key_values)


def _training(model, vocab: int):
    from ..training import token_logprobs

    for name, param in model.named_parameters():  # their gradients would be written whole: vocabulary x hidden
        param.requires_grad_(not any(part in name for part in ("embed_tokens", "lm_head")))
    ids, mask = _rows(vocab)
    token_logprobs(model, ids, mask).sum().backward()


def _engine(model, vocab: int, **options):
    from ..engine import Engine, SamplingParams

    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=256, kv_cache_memory=64 << 20, **options)
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0, logprobs=1)
    # 600 tokens: more than one KV chunk, so the decode steps run the paged chunks in parallel
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (9, 600)]
    return engine, engine.generate(prompts, params)


def _lora(model, vocab: int, base):
    """PEFT's LoRA layers unmerged (forward), then two adapters in the engine's slots."""
    from peft import LoraConfig, get_peft_model

    from ..engine import Engine, SamplingParams

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"])
    peft_model = make_invariant(get_peft_model(model, config))
    ids, mask = _rows(vocab)
    with torch.no_grad():
        peft_model(input_ids=ids, attention_mask=mask)
    engine = Engine(base, max_num_seqs=2, max_num_batched_tokens=256, kv_cache_memory=64 << 20, max_loras=2,
                    max_lora_rank=8)
    engine.add_lora("a", peft_model)
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (9, 5)]
    engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), lora=["a", None])


def _vision(model, vocab: int):
    """An image through the vision tower (its windowed and full blocks) and the language model."""
    config = model.config
    vision = config.vision_config
    merge = vision.spatial_merge_size
    grid = torch.tensor([[1, 8 * merge, 8 * merge]])  # 16 x 16 patches: 64 merged tokens
    patches = int(grid.prod())
    pixels = torch.randn(patches, 3 * vision.temporal_patch_size * vision.patch_size ** 2, dtype=DTYPE)
    ids = torch.cat([torch.randint(0, 1000, (3,)), torch.tensor([config.vision_start_token_id]),
                     torch.full((patches // merge ** 2,), config.image_token_id), torch.randint(0, 1000, (4,))])[None]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, image_grid_thw=grid)


def _dense(name: str, paths: tuple[str, ...]) -> Callable[[], None]:
    def run():
        vocab = 1000
        for path in paths:
            model = uninitialised_model(name)
            if path == "forward":
                _forward(model, vocab)
            elif path == "training":
                _training(model, vocab)
            elif path == "engine":
                _engine(model, vocab)
            elif path == "lora":
                _lora(model, vocab, uninitialised_model(name))
            elif path == "vision":
                _vision(model, vocab)
    return run


def _quantized(scheme: str) -> Callable[[], None]:
    """A quantized checkpoint of Qwen2.5-1.5B's layer widths: its forward and the engine on it."""
    def run():
        from transformers import AutoModelForCausalLM

        from ..checkpoints.quantized import quantized_loading
        from .quantized_checkpoints import save_fp8_checkpoint, save_quantized_checkpoint

        config = model_config("qwen2.5-1.5b", vocab_size=QUANTIZED_VOCAB, tie_word_embeddings=False)
        if scheme == "moe-fp8":
            config = model_config("qwen3-30b-a3b", vocab_size=QUANTIZED_VOCAB, tie_word_embeddings=False)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder)
            with paused_recording():
                if scheme in ("fp8", "moe-fp8"):
                    save_fp8_checkpoint(path, config)
                else:
                    save_quantized_checkpoint(path, config, scheme)
                with quantized_loading():
                    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE).eval()
            make_invariant(model)
            _forward(model, QUANTIZED_VOCAB)
            _engine(model, QUANTIZED_VOCAB)
    return run


def _pooling() -> None:
    """Pooled embeddings at Qwen3-Embedding's widths (0.6B: 1024, 8B: 4096): every summed mode and the
    L2 normalisation, in the model dtype and fp32."""
    from ..kernels import l2_normalize, pool_tokens

    for hidden in (1024, 4096):
        for dtype in (DTYPE, torch.float32):
            x = torch.empty(3, 12, hidden, dtype=dtype)
            start, end = torch.tensor([0, 4, 2]), torch.tensor([12, 12, 9])
            for weighted, divisor in ((False, "count"), (True, "weight_sum"), (False, "sqrt_count")):
                pool_tokens(x, start, end, weighted, divisor)
            l2_normalize(x[:, 0])


def _encoders() -> None:
    """BERT-base and XLM-R-base widths (one layer), as ``AutoModel`` and as a classifier: two rows, one
    left-padded (LayerNorm, GELU, the bidirectional attention, the pooler's and head's tanh)."""
    from transformers import AutoModel, AutoModelForSequenceClassification
    from transformers.initialization import no_init_weights

    from ..model.families import ENCODER_FAMILIES

    for family, preset in (("bert", "bert-base"), ("xlm-roberta", "xlm-roberta-base")):
        adapter = ENCODER_FAMILIES[family]
        config = adapter.config_class(**{**adapter.presets[preset], "num_hidden_layers": 1, "vocab_size": 1000})
        for auto in (AutoModel, AutoModelForSequenceClassification):
            with paused_recording(), no_init_weights():
                model = make_invariant(auto.from_config(config, dtype=DTYPE).eval())
            ids, mask = _rows(1000)
            with torch.no_grad():
                model(input_ids=ids.clamp(min=3), attention_mask=mask)


WORKLOADS: dict[str, Callable[[], None]] = {
    "qwen2.5-1.5b": _dense("qwen2.5-1.5b", ("forward", "training", "engine", "lora")),
    "qwen2.5-7b": _dense("qwen2.5-7b", ("forward",)),
    "llama-3.1-8b": _dense("llama-3.1-8b", ("forward", "training")),
    "gpt-oss-20b": _dense("gpt-oss-20b", ("forward", "engine")),
    "qwen3.5-9b": _dense("qwen3.5-9b", ("forward", "training", "engine")),
    "qwen2.5-vl-7b": _dense("qwen2.5-vl-7b", ("vision", "training")),
    "qwen3-vl-2b": _dense("qwen3-vl-2b", ("vision",)),
    "gemma-3-4b": _dense("gemma-3-4b", ("forward", "training")),
    "qwen3-30b-a3b": _dense("qwen3-30b-a3b", ("forward", "engine")),
    "deepseek-v3": _dense("deepseek-v3", ("forward", "engine")),
    "glm-4.5-air": _dense("glm-4.5-air", ("forward",)),
    **{f"compressed-tensors {scheme}": _quantized(scheme) for scheme in COMPRESSED_TENSORS_SCHEMES},
    "transformers fp8": _quantized("fp8"),
    "transformers fp8 moe": _quantized("moe-fp8"),
    "pooling": _pooling,
    "encoders": _encoders,
}


def record_variants(names=None) -> dict:
    """{variant: [the workloads that launch it]} over the named workloads (default: all)."""
    found: dict = {}
    for name in names or WORKLOADS:
        with recorded_launches() as recorder:
            WORKLOADS[name]()
        for variant in recorder.variants:
            found.setdefault(variant, []).append(name)
    return found
