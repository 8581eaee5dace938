"""What runs where: one table of the model kinds by surface, and the finer features some surfaces
refuse. Every refusal of a kind or feature on a surface raises from here (``require``), with the
table's error class and message, so the docs (``markdown``) and the errors say the same thing.

A kind is a property of a loaded model (``invariant_infer.model.kinds.model_kinds`` derives them);
a surface is a way of running it. A row applies when all its kinds are present, so a combination
row (LoRA adapters on a hybrid model) refuses only that combination.

The docs' copy of the table is generated from it: ``invariant_infer.model.support_table``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from ..errors import (InvalidArgumentError, JobError, NonInvariantInputError, RequestError, SpeculativeConfigError,
                      UnsupportedModelError, UnsupportedOperationError, UnsupportedTRLError)
from ..kernels.fp8_support import FP8_LABEL, FP8_REASON

# name -> (label in messages, column heading in the docs)
SURFACES: dict[str, tuple[str, str]] = {
    "model": ("make_invariant", "`model(...)`"),
    "generate": ("generate", "`generate`"),
    "engine": ("the engine", "engine"),
    "speculative": ("speculative decoding", "speculative"),
    "tensor_parallel": ("tensor parallelism", "tensor parallel"),
    "training": ("training (backward, token_logprobs)", "training"),
    "trl": ("TRL GRPO (InvariantGRPOTrainer)", "TRL GRPO"),
    "scoring": ("scoring (score_sequences, invariant-infer score)", "scoring"),
    "ray": ("invariant-infer score --ray", "`score --ray`"),
    "serve": ("invariant-infer serve", "`serve`"),
}
EVERY_SURFACE = tuple(SURFACES)


@dataclass(frozen=True)
class Refusal:
    reason: str          # why, and what to use instead
    error: type = UnsupportedModelError


@dataclass(frozen=True)
class Row:
    name: str
    label: str                           # in messages: "<surface> does not run <label>: <reason>"
    kinds: frozenset[str]                # the row applies when the model has all of these
    refused: dict[str, Refusal] = field(default_factory=dict)  # surface -> refusal; the others run it
    title: str = ""                      # in the docs (the label when empty)
    feature: bool = False                # a finer refusal: the features list, not the kinds matrix

    def message(self, surface: str) -> str:
        return f"{SURFACES[surface][0]} does not run {self.label}: {self.refused[surface].reason}"


def _no(reason: str, surfaces=EVERY_SURFACE, error: type = UnsupportedModelError, errors=None) -> dict:
    """The same reason on each of ``surfaces``; ``errors`` overrides the error class per surface."""
    return {s: Refusal(reason, (errors or {}).get(s, error)) for s in surfaces}


def _row(name, label, refused=None, kinds=None, title="", feature=False) -> Row:
    return Row(name, label, frozenset(kinds or (name,)), refused or {}, title, feature)


_PER_CHANNEL_TP = ("their activation scale spans the whole row, which a row-parallel shard would split; run them "
                   "at tensor-parallel size 1, or use an FP8_BLOCK or W4A16 / W8A16 (grouped) checkpoint")

# The kinds matrix: one row per kind, in this order in the docs.
KINDS = [
    _row("dense", "dense models", title="dense (Qwen2 / 2.5, Qwen3, Llama 3.x, Mistral, Gemma 3, Gemma 4 text)"),
    _row("latent_attention", "multi-head latent attention (MLA)",
         title="multi-head latent attention, absorbed, the latent cached (DeepSeek-V3)",
         refused=_no("the latent heads are not sharded yet; run the model in one process (tensor parallel size 1)",
                     ("tensor_parallel",))
         | _no("the absorbed attention's per-head products have no backward yet; run MLA models under "
               "torch.no_grad() / torch.inference_mode()", ("training",))
         | _no("the absorbed attention's per-head products have no backward yet", ("trl",), UnsupportedTRLError)),
    _row("moe", "mixture-of-experts models",
         title="mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, GLM-4.5, DeepSeek-V3, Gemma 4 26B-A4B)",
         refused=_no("the experts' K trees are not split across ranks; run the model in one process (no tp_plan, "
                     "tensor parallel size 1)", ("tensor_parallel",))
         | _no("MoE training is not supported: the invariant router and experts have no backward (and the router "
               "aux loss is not covered); run MoE models under torch.no_grad() / torch.inference_mode(), or freeze "
               "every parameter (model.requires_grad_(False))", ("training",))
         | _no("the router and experts have no backward and the MoE load-balancing loss is not covered; GRPO runs "
               "the dense, hybrid dense and vision-language families", ("trl",), UnsupportedTRLError)),
    _row("hybrid", "models with Gated DeltaNet (linear attention) layers",
         title="hybrid, Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)",
         refused=_no("a rejected draft token would have to leave the layers' state; run them without speculative",
                     ("speculative",))),
    _row("vision_language", "vision-language models", title="vision-language, images (Qwen2.5-VL, Qwen3-VL)",
         refused=_no("speculation does not carry the images' features and multimodal positions yet; run them "
                     "without speculative", ("speculative",))
         | _no("the vision tower is not sharded yet; run them in one process", ("tensor_parallel",))),
    _row("windowed", "sliding-window layers and attention sinks",
         title="sliding windows, attention sinks (Gemma 3, Gemma 4, windowed Mistral / Mixtral, gpt-oss, "
               "`use_sliding_window`)"),
    _row("fp8_dynamic", "compressed-tensors FP8 checkpoints with per-channel or per-tensor scales",
         title="compressed-tensors FP8_DYNAMIC (and FP8: per-channel, per-tensor scales)",
         refused=_no(_PER_CHANNEL_TP, ("tensor_parallel",))),
    _row("fp8_block", "compressed-tensors FP8_BLOCK checkpoints", title="compressed-tensors FP8_BLOCK"),
    _row("w8a8_int8", "compressed-tensors W8A8 int8 checkpoints", title="compressed-tensors W8A8 int8",
         refused=_no(_PER_CHANNEL_TP, ("tensor_parallel",))),
    _row("w4a16_int4", "compressed-tensors W4A16 / W8A16 (grouped) checkpoints",
         title="compressed-tensors W4A16 int4 (and W8A16, grouped)"),
    _row("transformers_fp8", "transformers' fp8 checkpoints", title="transformers `fp8` (128 x 128 blocks)",
         refused=_no("the shards do not serve transformers' fp8 format yet; run it at tensor-parallel size 1, or use "
                     "a compressed-tensors FP8_BLOCK checkpoint", ("tensor_parallel",))),
    _row("mxfp4", "MXFP4 experts", title="MXFP4 (gpt-oss's released experts)",
         refused=_no("MXFP4 experts are not supported yet; load the checkpoint with "
                     "quantization_config=Mxfp4Config(dequantize=True) to run bf16 experts")),
    _row("lora", "LoRA adapters", title="PEFT LoRA adapters (unmerged; the engine's adapter slots)",
         refused=_no("adapters are scored in one process; run the job without --ray", ("ray",), JobError)),
    _row("encoder", "encoders",
         title="encoders (BERT, XLM-RoBERTa, ModernBERT: `AutoModel`, `...ForSequenceClassification`)",
         refused=_no("encoders run through make_invariant only so far: call the patched model for its hidden states, "
                     "pooler output or classification logits", ("engine", "speculative"))
         | _no("score_sequences computes a causal LM's token logprobs; an encoder's embeddings or scores come from "
               "`invariant-infer score` on its pooled checkpoint (a base model, ...ForSequenceClassification, a "
               "sentence-transformers folder) or load_pooled_model", ("scoring",))
         | _no("GRPO trains a causal LM that samples its rollouts; an encoder (a reward model, a cross-encoder) "
               "runs in InvariantGRPOTrainer as one of its reward_funcs, which the trainer patches", ("trl",))
         | _no("the commands load causal LMs, image-text-to-text models and pooled checkpoints (base models, "
               "...ForSequenceClassification, sentence-transformers folders); load another encoder head with "
               "transformers and call make_invariant", ("ray",))
         | _no("the encoder layers are not sharded yet; run them in one process", ("tensor_parallel",))
         | _no("encoders do not generate", ("generate",))),
]

# Finer refusals: features and combinations of kinds, each on the surfaces that refuse it.
FEATURES = [
    _row("stock_engine_hybrid", "models with Gated DeltaNet (linear attention) layers with kernels='stock'",
         kinds=("hybrid", "stock_kernels"), feature=True,
         refused=_no("the engine keeps their states in slots only on the invariant kernels; use "
                     "kernels='invariant'", ("engine",))),
    _row("stock_engine_vision_language", "vision-language models with kernels='stock'",
         kinds=("vision_language", "stock_kernels"), feature=True,
         refused=_no("the engine merges image features only on the invariant kernels; use kernels='invariant'",
                     ("engine",))),
    _row("stock_speculative", "kernels='stock'", kinds=("stock_kernels",), feature=True,
         refused=_no("speculative decoding is exact only with kernels='invariant' (stock kernels give a verify step "
                     "other logits than decode steps)", ("speculative",), SpeculativeConfigError)),
    _row("stock_engine_latent_attention", "multi-head latent attention (MLA) with kernels='stock'",
         kinds=("latent_attention", "stock_kernels"), feature=True,
         refused=_no("the engine's pages hold the latent, which only the absorbed attention of kernels='invariant' "
                     "reads; use kernels='invariant'", ("engine",))),
    _row("hybrid_lora", "LoRA adapters on models with Gated DeltaNet (linear attention) layers",
         kinds=("hybrid", "lora"), feature=True,
         refused=_no("LoRA on the Gated DeltaNet projections is not supported yet; run the base model",
                     ("model", "engine"))),
    _row("vision_language_lora", "LoRA adapters on vision-language models", kinds=("vision_language", "lora"),
         feature=True,
         refused=_no("the engine's adapter slots and score --lora do not take vision-language models yet; run the "
                     "base model", ("engine", "scoring"), errors={"scoring": JobError})),
    _row("hybrid_quantized_tensor_parallel", "quantized checkpoints with Gated DeltaNet (linear attention) layers",
         kinds=("hybrid", "quantized"), feature=True,
         refused=_no("their layers' shards are not quantized yet; run them at tensor-parallel size 1",
                     ("tensor_parallel",))),
    _row("peft_model_tensor_parallel", "a PeftModel", kinds=("peft_model",), feature=True,
         refused=_no("a PeftModel runs at tensor-parallel size 1 only; serve adapters on a tensor-parallel model "
                     "through Engine(..., max_loras=N).add_lora (serve --lora-modules)", ("tensor_parallel",))),
    _row("quantized_lora_tensor_parallel", "adapter slots on quantized checkpoints", kinds=("quantized", "lora"),
         feature=True,
         refused=_no("adapter slots on a quantized checkpoint run at tensor-parallel size 1 only; serve adapters at "
                     "TP > 1 on an unquantized checkpoint", ("tensor_parallel",))),
    _row("compressed_tensors_moe", "compressed-tensors mixture-of-experts checkpoints", feature=True,
         refused=_no("transformers decompresses their experts to the float dtype at load. Quantized experts are "
                     "supported in transformers' fp8 format (weight_block_size [128, 128], as the official Qwen3 MoE "
                     "FP8 checkpoints)")),
    _row("latent_attention_quantized",
         "multi-head latent attention (MLA) in quantized checkpoints other than transformers' fp8",
         feature=True,
         refused=_no("the absorbed attention reads kv_b_proj as float weights, which it dequantizes once from "
                     "transformers' fp8 format (DeepSeek-V3's release) only; load that format, or dequantize the "
                     "checkpoint to bf16 first")),
    # raised by the fp8 kernels' launchers (kernels.fp8_support), with this label and reason
    _row("fp8_before_sm89", FP8_LABEL, feature=True, refused=_no(FP8_REASON, error=UnsupportedOperationError)),
    _row("videos", "videos", feature=True,
         refused=_no("only images are supported; pass images (pixel_values, multi_modal_data {'image': [...]})",
                     ("model", "engine", "scoring"), NonInvariantInputError,
                     errors={"engine": RequestError, "scoring": InvalidArgumentError})),
    _row("trainable_vision_tower", "a trainable vision tower", feature=True,
         refused=_no("its backward is not supported yet: freeze it (model.model.visual.requires_grad_(False)) or run "
                     "under torch.no_grad()", ("training", "trl"), NonInvariantInputError,
                     errors={"trl": UnsupportedTRLError})),
    _row("vision_language_sliding_window", "Qwen2.5-VL's sliding-window layers (text_config.use_sliding_window)",
         feature=True, refused=_no("they are not supported yet; load the checkpoint with use_sliding_window=False")),
    _row("logit_softcapping", "logit softcapping (attn_logit_softcapping, final_logit_softcapping)", feature=True,
         refused=_no("logit softcapping is not supported yet; the kernels never drop it silently")),
    _row("gemma4_text_training", "Gemma 4 (gemma4_text)", kinds=("gemma4_text",), feature=True,
         refused=_no("its backward (per-layer inputs, KV-shared layers, softcapped logits) is not tested yet; run it "
                     "under torch.no_grad() / torch.inference_mode()", ("training", "trl"),
                     errors={"trl": UnsupportedTRLError})
         | _no("its global layers' own head_dim and KV heads are not sharded yet; run it in one process",
               ("tensor_parallel",))
         | _no("a draft's rejected tokens and the KV-shared layers are not tested together yet; run it without "
               "speculative", ("speculative",))),
    # raised by the gemma4 multimodal model's forwards (model.gemma4_multimodal) before any compute
    _row("gemma4_images_audio", "images, videos and audio on Gemma 4 (model type gemma4: pixel_values, "
         "pixel_values_videos, input_features, mm_token_type_ids marking any)", feature=True,
         refused=_no("Gemma 4's vision and audio towers are not on the invariant kernels yet; its text runs (input_ids "
                     "or inputs_embeds with their attention_mask)", ("model",), NonInvariantInputError)),
    _row("softcap_argument", "attention logit softcapping (softcap)", feature=True,
         refused=_no("invariant attention has no softcapping yet, and never drops it", ("model", "engine"),
                     NonInvariantInputError)),
    _row("encoder_packed_rows", "packed rows on encoders (cu_seq_lens_*, position_ids restarting)", feature=True,
         refused=_no("each row of an encoder's batch holds one sequence: pass padded rows with their attention_mask",
                     ("model",), NonInvariantInputError)),
    _row("encoder_train_mode", "encoders in train mode (dropout)", feature=True,
         refused=_no("dropout's draws depend on the batch's shape, so no row's output or gradient would be its own; "
                     "train BERT and XLM-R in eval mode (model.eval(): backward runs, no dropout)",
                     ("model", "training"), NonInvariantInputError)),
    _row("modernbert_training", "ModernBERT training", feature=True,
         refused=_no("its GeGLU MLP and head run forward-only kernels: run ModernBERT under torch.no_grad() / "
                     "torch.inference_mode(), or freeze every parameter (model.requires_grad_(False)); BERT and "
                     "XLM-R train in eval mode", ("training",), NonInvariantInputError)),
    _row("bidirectional_attention", "bidirectional attention (use_bidirectional_attention)", feature=True,
         refused=_no("only causal attention is supported")),
    _row("architecture_not_causal_lm", "sequence or token classification heads, encoders and base models",
         title="checkpoints whose architecture is not a causal LM or image-text-to-text model (classification "
               "heads, encoders, base `...Model` classes)", feature=True,
         refused=_no("invariant-infer runs causal LMs and image-text-to-text models; another head loaded as a causal "
                     "LM would get a random LM head (serve, score and load_pooled_model take base models, "
                     "...ForSequenceClassification and sentence-transformers folders as pooled models)")),
    _row("unsupported_model_type", "model types outside the supported families", feature=True,
         refused=_no("invariant-infer runs the supported families only; make_invariant patches only their layers "
                     "onto the invariant kernels")),
    _row("tensor_parallel_ray", "--tensor-parallel-size", kinds=("tensor_parallel_job",), feature=True,
         refused=_no("each Ray worker holds the whole model; scale with --num-workers instead", ("ray",), JobError)),
]

ROWS = KINDS + FEATURES
BY_NAME = {row.name: row for row in ROWS}
KNOWN_KINDS = {name for row in ROWS for name in row.kinds}


def refusal(kinds, surface: str) -> tuple[Row, Refusal] | None:
    """The first row that refuses ``kinds`` (all of a row's kinds present) on ``surface``, or None."""
    if surface not in SURFACES:
        raise InvalidArgumentError(f"unknown surface {surface!r}; surfaces: {list(SURFACES)}")
    kinds = set(kinds)
    if kinds - KNOWN_KINDS:  # a misspelt kind would never be refused
        raise InvalidArgumentError(f"unknown kinds {sorted(kinds - KNOWN_KINDS)}; kinds: {sorted(KNOWN_KINDS)}")
    for row in ROWS:
        if surface in row.refused and row.kinds <= kinds:
            return row, row.refused[surface]
    return None


def refusal_message(row: Row, surface: str, subject: str | None = None) -> str:
    message = row.message(surface)
    return f"{subject}: {message}" if subject else message


def require(kinds, surface: str, subject: str | None = None, **error_fields) -> None:
    """Raise the table's error, with its message (prefixed ``subject: ``), when ``surface`` does not run
    ``kinds`` (a kind name or an iterable of them); ``error_fields`` go to the error where its class takes
    them (``RequestError``'s ``param``)."""
    found = refusal({kinds} if isinstance(kinds, str) else kinds, surface)
    if found is not None:
        row, refused = found
        taken = inspect.signature(refused.error.__init__).parameters
        raise refused.error(refusal_message(row, surface, subject),
                            **{name: value for name, value in error_fields.items() if name in taken})


def supports(kinds, surface: str) -> bool:
    return refusal({kinds} if isinstance(kinds, str) else kinds, surface) is None
