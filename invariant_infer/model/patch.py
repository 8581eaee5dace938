"""``make_invariant(model)``: patch one loaded model in place, per instance.

Which classes are patched comes from the model family's adapter (``invariant_infer.model.families``).
What changes (and nothing process-wide):
  * every ``nn.Linear`` (q/k/v/o, gate/up/down, with or without bias, lm_head) -> fixed-order Triton linear;
    the row-parallel ones (o_proj, down_proj) reduce K as the tree tensor parallelism splits
    (``kernels.configs.row_parallel_config``), so their bits do not depend on the TP size;
  * a model that transformers sharded for tensor parallelism: each sharded module runs the
    TP-size-invariant forward of ``invariant_infer.model.tensor_parallel`` instead of transformers' hooks;
  * every RMSNorm of the family (layer norms, final norm, Qwen3's per-head q/k norms) -> one-row-per-program
    Triton RMSNorm;
  * every MLP of the family -> same projections, with silu(gate) * up fused into the down projection
    (these linear, RMSNorm and MLP forwards are ``invariant_infer.model.layer_forwards``'s);
  * the rotary embedding -> lookup in a cos/sin table computed once per model;
  * attention -> the ``invariant`` attention and mask functions (see ``model.attention``); DeepSeek-V3's
    latent attention -> its absorbed forward on them (``model.latent_attention``; an fp8 ``kv_b_proj``
    is dequantized once, the weight the absorbed products read);
  * in mixture-of-experts families, every router -> the invariant linear and routing, and the
    experts -> the ``invariant`` experts implementation (see ``model.experts``), and fp8 experts of
    transformers' fp8 format (``FP8Experts``) -> ``model.quantized_experts``; MoE forwards that
    would record autograd are refused (MoE training is not supported);
  * a pre-forward hook on the base model derives ``position_ids`` from the mask
    (cumsum - 1, pads at 0), reading nothing back; a pre-forward hook on the model the caller calls
    rejects masks that cannot be invariant before the decoder runs (``input_checks.py``); for packed rows
    (no mask, position_ids restarting, ``cu_seq_lens_*``) it checks the layout and hands
    attention the per-sequence regrouping (``invariant_infer.model.packing``);
  * a PEFT ``PeftModel``: the model inside is patched, and each LoRA layer adds its adapters'
    ``scaling * B(A(x))`` on the invariant linear, unmerged (``invariant_infer.model.lora``);
  * an encoder family's model (BERT, XLM-RoBERTa, ModernBERT: ``AutoModel``, ``...ForSequenceClassification``):
    its linears, LayerNorms, GELU, bidirectional attention, positions, pooler and classification head
    (``invariant_infer.model.encoder``; ModernBERT: ``invariant_infer.model.modernbert``), inference only;
  * registered instance extensions run (``invariant_infer.generation.generate`` registers one that makes
    ``model.generate`` on this instance reject options that are not batch-invariant).
Every patched op is differentiable: with grad enabled it runs as an autograd Function over the same
forward kernel (the same bits as inference) with a batch-invariant, deterministic backward, so the
model trains on the kernels it samples with. Parameters stay the model's own ``nn.Parameter``s.
Each patched module keeps one ``ModuleState`` (``module_state.py``): the forward it had, and what
its new forward reads (a TP layout, a quantized plan, a dequantized weight, rope tables, adapter
slots). ``restore(model)`` undoes all of it.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import attention as attention_interface, experts as experts_interface
from ..errors import NonInvariantInputError, NonInvariantOpError, UnsupportedModelError
from .audit import audit
from .checks import check_model, multimodal_model, unpatched_modules
from .encoder import install_generate_refusal, patch_encoder, remove_generate_refusal
from .families import attention_setting, encoder_family_of, text_config
from .modernbert import patch_modernbert
from .gated_attention import gated_attention_forward
from .layer_forwards import (dequantized_linear_forward, fp32_scaled_rms_norm_forward, gelu_tanh_mlp_forward,
                             linear_forward, mlp_forward, quantized_mlp_forward, rms_norm_forward,
                             row_linear_forward, zero_centred_rms_norm_forward)
from .latent_attention import absorbed_projections, latent_attention_forward
from .linear_attention import gated_delta_net_forward
from .lora import base_linear, check_peft, has_unpatched_lora, peft_lora_forward, refuse_quantized_merge, unwrap_peft
from .module_state import module_state, remove_state, state_of
from .multimodal import multimodal_pre_hook
from .rope import mrope_axes, rotary_forward, set_rope_tables
from .packing import FLASH_KWARGS, PACKED_KWARG, resolve_packed
from .padding import cache_length, is_sequence_bounds, resolve_positions
from .input_checks import (bind_forward_arguments, check_inputs, checked_at_entry, generating, install_entry_checks,
                           max_positions_of)
from .quantization import (dequantize_fp8, detach_decompression, freeze_compressed, quantized_forward,
                           row_parallel_plan)
from .quantized_experts import quantized_experts_forward
from .sentence_transformers import (is_sentence_transformers_model, patch_sentence_transformers,
                                    restore_sentence_transformers, sentence_transformers_patched)
from .tensor_parallel import tp_forwards, tp_layout

_STATE_ATTR = "_invariant_infer_state"


@dataclass
class ModelPatch:
    """What ``make_invariant`` changed on the model as a whole (each patched module keeps its own
    ``ModuleState``); ``restore`` undoes it."""
    hooks: list                       # the pre-forward hook handles (base model; multimodal model)
    attn_implementation: str | dict | None  # the config's before the patch (the text config's: {"text_config": ...})
    experts_implementation: str | None  # likewise, for MoE families (None: not changed)
    extensions: list                  # the (install, remove) pairs that ran
    reattach_decompression: Any       # puts compressed-tensors' decompression hooks back (None: none taken)
    hub_kernels: bool                 # transformers' hub kernelization was on


# ---- input handling ------------------------------------------------------------------------------

def _base_pre_hook(module, args, kwargs):
    kwargs = bind_forward_arguments(module, args, kwargs)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and not is_sequence_bounds(mask):
        raise NonInvariantInputError("4-D attention masks are not supported; pass the 2-D padding mask")
    if kwargs.get("logits_to_keep"):  # only Gemma 4's decoder takes it (transformers 5.25 on)
        raise NonInvariantInputError(
            "logits_to_keep on the decoder: it would cut the KV-shared layers' rows while the attention bounds still "
            "describe every query; call the causal LM (which keeps rows after the decoder) or slice the output")
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        return (), kwargs
    # The checks that read values back ran at the call's entry point (input_checks.py); a decoder called
    # alone is checked here. Tracing (compiled decode) skips them: generate() checked up front.
    compiling = torch.compiler.is_compiling()
    if not compiling and module.training:
        _refuse_dropout(module)
    multimodal_rope = state_of(module.rotary_emb).mrope_axes is not None  # its positions are made past the entry
    if not compiling and (not checked_at_entry(module) or multimodal_rope):
        check_inputs(module, kwargs)
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:  # multimodal RoPE: per-row, as given
        if any(kwargs.get(name) is not None for name in FLASH_KWARGS):
            raise NonInvariantInputError("packed rows (cu_seq_lens_*) with multimodal positions are not supported; "
                                         "pass padded rows with their attention_mask")
        return (), kwargs
    if not compiling and mask is None:
        # Packed rows (position_ids restarting, cu_seq_lens_*): attention regroups them per sequence. Their
        # layout is read back here; generate's rows (checked at its entry) are never packed.
        flash = {name: kwargs.pop(name) for name in FLASH_KWARGS if name in kwargs}
        positions, packed = kwargs.get("position_ids"), None
        if (positions is not None or flash) and not generating(module):
            positions, packed = resolve_packed(
                positions, flash, batch=tokens.shape[0], length=tokens.shape[1],
                cache_length=cache_length(kwargs), max_positions=max_positions_of(module), device=tokens.device)
        if packed is not None:
            kwargs["attention_mask"] = packed.bounds()
            kwargs[PACKED_KWARG] = packed
    else:
        if any(kwargs.get(name) is not None for name in FLASH_KWARGS):
            raise NonInvariantInputError("cu_seq_lens_*/max_length_* describe packed rows, which take no "
                                         "attention_mask and run eagerly (not under torch.compile)")
        positions = resolve_positions(mask, kwargs.get("position_ids"), query_length=tokens.shape[1],
                                      cache_length=0, max_positions=max_positions_of(module), check=False)
    if positions is not None:
        kwargs["position_ids"] = positions
    return (), kwargs


def _refuse_dropout(base: nn.Module) -> None:
    """Train mode applies attention dropout, whose random mask depends on where a sample sits in
    the batch: refuse it rather than train on batch-dependent numbers."""
    for index, layer in enumerate(base.layers):
        rate = getattr(getattr(layer, "self_attn", None), "attention_dropout", 0.0)
        if rate:
            raise NonInvariantInputError(
                f"layers.{index}.self_attn has attention_dropout={rate} and the model is in train mode: dropout is "
                "not batch-invariant. Load the model with attention_dropout=0.0 (these families ship with 0) or "
                "call model.eval().")
        jitter = getattr(layer.mlp, "jitter_noise", 0.0)  # Mixtral's router_jitter_noise
        if jitter:
            raise NonInvariantInputError(
                f"layers.{index}.mlp has router_jitter_noise={jitter} and the model is in train mode: the noise is "
                "random per token, not batch-invariant. Call model.eval() or load with router_jitter_noise=0.0.")


# ---- public API -------------------------------------------------------------------------------------

# (install, remove) pairs run on every model make_invariant patches, e.g. the generate checks,
# which ``invariant_infer.generation.generate`` registers; the patcher itself knows nothing of them.
_INSTANCE_EXTENSIONS: list[tuple] = []


def register_instance_extension(install, remove) -> None:
    """Run ``install(model)`` on each model ``make_invariant`` patches and ``remove(model)`` on restore."""
    if (install, remove) not in _INSTANCE_EXTENSIONS:
        _INSTANCE_EXTENSIONS.append((install, remove))


def _set_forward(module: nn.Module, fn) -> None:
    # An instance-level forward already there (transformers' TP hooks) comes back on restore.
    state = module_state(module)
    state.previous_forward, state.forward_patched = module.__dict__.get("forward"), True
    module.forward = types.MethodType(fn, module)


def _turn_off_hub_kernels(model: nn.Module) -> bool:
    """transformers (5.25 on, with Hugging Face's ``kernels`` package, which it depends on) kernelizes
    a loaded model by default, and again on every ``train()`` / ``eval()`` that changes the mode,
    which replaces the layers' forwards, these patches' included, with hub kernels or torch fallbacks.
    Kernelization stays off while the model is patched; returns whether it was on."""
    if not getattr(model, "use_kernels", False):
        return False
    model.reset_kernels()
    return True


def make_invariant(model: nn.Module, strict: bool = False) -> nn.Module:
    """Patch a loaded model of a supported family in place so its logits are bitwise batch-invariant.

    A compressed-tensors checkpoint keeps its compressed weights and runs the quantized GEMM
    (``invariant_infer.model.quantization``).

    ``strict=True`` fails closed, in two ways: it refuses a checkpoint's dynamic per-tensor activation
    scale instead of replacing it by a per-token one; and, once patched, it runs ``audit`` (one probe
    forward: two short padded rows) and raises ``NonInvariantOpError``, naming each module and op,
    when any op reduces floats outside the invariant kernels (a forward hook, a module or config path
    the patch does not cover, a transformers release that changed a forward), restoring the model
    first. Off by default: the probe forward costs one forward of the model (and, on CPU, a run of
    every kernel through Triton's interpreter), every supported family and format is audited by the
    test suite, and a dynamic per-tensor scale is replaced rather than refused (docs/how-it-works.md,
    "Fail-closed coverage: audit and strict").
    A sentence-transformers ``SentenceTransformer`` or ``CrossEncoder`` is patched as a whole
    (``invariant_infer.model.sentence_transformers``).
    Returns the same model. Idempotent. Undo with ``restore(model)``."""
    if is_sentence_transformers_model(model):
        return patch_sentence_transformers(model, make_invariant, is_invariant, restore, strict)
    was_patched = getattr(unwrap_peft(model), _STATE_ATTR, None) is not None
    patched = _patch(model, strict)
    if strict:
        _refuse_stray_ops(patched, restore_on_refusal=not was_patched)
    return patched


def _refuse_stray_ops(model: nn.Module, restore_on_refusal: bool) -> None:
    """Audit ``model``; on a stray op, restore it (unless the caller had patched it before) and raise."""
    try:
        report = audit(model)
    except BaseException:  # the probe forward failed: strict leaves no model patched unaudited
        if restore_on_refusal:
            restore(model)
        raise
    if report.ok:
        return
    if restore_on_refusal:
        restore(model)
    ops = "; ".join(f"{op} in {module or '<model>'}" for module, op in report.stray)
    raise NonInvariantOpError(
        f"make_invariant(strict=True): the patched forward reduces outside the invariant kernels, so its results "
        f"could depend on the batch: {ops}. "
        f"{'The model was restored. ' if restore_on_refusal else 'The model stays as patched before. '}"
        "Remove the hook or module that issues the op "
        "(or, knowingly, patch without strict=True)", report.stray)


def _patch(model: nn.Module, strict: bool) -> nn.Module:
    wrapper, model = model, unwrap_peft(model)  # a PeftModel: patch the model inside, LoRA layers unmerged
    if getattr(model, _STATE_ATTR, None) is not None:
        if not has_unpatched_lora(model):
            return wrapper
        restore(model)  # LoRA layers came after the patch (get_peft_model on a patched model): patch them too
    encoder = encoder_family_of(getattr(model, "config", None))
    if encoder is not None:
        return _patch_encoder(wrapper, model, encoder)
    check_peft(wrapper)
    layout = tp_layout(model)
    adapter, base, quantized, experts, adapters = check_model(model, sharded=layout is not None, strict=strict)
    absorbed = absorbed_projections(model, adapter, quantized)  # read dequantized, out of ``quantized``
    row_parallel = {base_linear(proj) for layer in base.layers for name, proj in adapter.projections(layer).items()
                    if name in adapter.row_parallel}
    quantized = {module: row_parallel_plan(plan, module.in_features) if module in row_parallel else plan
                 for module, plan in quantized.items()}
    sharded = tp_forwards(model, adapter, base, layout, quantized) if layout is not None else {}
    attention_interface.register()
    hub_kernels = _turn_off_hub_kernels(model)

    router_forward = experts_interface.router_forward(adapter.moe) if adapter.moe else None
    block_forward = experts_interface.sparse_block_forward(adapter.moe) if adapter.moe else None
    unpatched = unpatched_modules(model, adapter)
    for module in model.modules():
        if module in unpatched:
            continue
        if module in sharded:
            _set_forward(module, sharded[module])
        elif module in quantized or module in experts:
            module_state(module).quantized = quantized.get(module) or experts[module]
            freeze_compressed(module)
            _set_forward(module, quantized_forward if module in quantized else quantized_experts_forward)
        elif module in absorbed:
            module_state(module).dequantized_weight = dequantize_fp8(absorbed[module].weight,
                                                                     model.get_input_embeddings().weight.dtype)
            freeze_compressed(module)
            _set_forward(module, dequantized_linear_forward)
        elif module in adapters:
            module_state(module).peft_lora = True
            _set_forward(module, peft_lora_forward)
            refuse_quantized_merge(module, quantized)
        elif type(module) is nn.Linear:
            _set_forward(module, row_linear_forward if module in row_parallel else linear_forward)
        elif type(module) is adapter.rms_norm:
            _set_forward(module, zero_centred_rms_norm_forward if adapter.zero_centred_norms else
                         fp32_scaled_rms_norm_forward if adapter.norms_scaled_in_fp32 else rms_norm_forward)
        elif adapter.linear_attention is not None and type(module) is adapter.linear_attention.module:
            _set_forward(module, gated_delta_net_forward)
        elif adapter.gated_attention is not None and type(module) is adapter.gated_attention:
            _set_forward(module, gated_attention_forward)
        elif adapter.latent_attention is not None and type(module) is adapter.latent_attention:
            _set_forward(module, latent_attention_forward)
        elif adapter.mlp is not None and type(module) is adapter.mlp:
            _set_forward(module, gelu_tanh_mlp_forward if adapter.mlp_activation == "gelu_tanh" else
                         quantized_mlp_forward if module.down_proj in quantized else mlp_forward)
        elif adapter.moe is not None and type(module) is adapter.moe.router:
            _set_forward(module, router_forward)
        elif block_forward is not None and type(module) is adapter.moe.block:
            _set_forward(module, block_forward)
        elif type(module) in adapter.module_forwards:
            _set_forward(module, adapter.module_forwards[type(module)])
        elif adapter.vision is not None and type(module) is adapter.vision.tower:
            adapter.vision.prepare(module)
            _set_forward(module, adapter.vision.forward)

    axes = mrope_axes(base.rotary_emb.mrope_section, adapter.mrope == "interleaved") if adapter.mrope else None
    set_rope_tables(base.rotary_emb, text_config(model.config).max_position_embeddings, adapter.rope_half_tables, axes)
    _set_forward(base.rotary_emb, rotary_forward)

    reattach_decompression = detach_decompression(model) if quantized else None
    hooks = [base.register_forward_pre_hook(_base_pre_hook, with_kwargs=True)]
    if model is not base and state_of(base.rotary_emb).mrope_axes is None:
        hooks += install_entry_checks(model, base)  # the checks that read values, before the decoder runs
    if adapter.vision is not None:  # the multimodal model around the language model
        hooks.append(multimodal_model(model).register_forward_pre_hook(multimodal_pre_hook, with_kwargs=True))
    previous_attn = attention_setting(model.config)  # towers that never run keep theirs
    model.set_attn_implementation(attention_setting(model.config, attention_interface.ATTN_IMPLEMENTATION))
    previous_experts = None
    if adapter.moe is not None:
        experts_interface.register()
        previous_experts = model.config._experts_implementation
        model.set_experts_implementation(experts_interface.EXPERTS_IMPLEMENTATION)
    extensions = list(_INSTANCE_EXTENSIONS)
    for install, _ in extensions:
        install(model)
    setattr(model, _STATE_ATTR, ModelPatch(hooks, previous_attn, previous_experts, extensions, reattach_decompression,
                                           hub_kernels))
    return wrapper


def _patch_encoder(wrapper: nn.Module, model: nn.Module, adapter) -> nn.Module:
    """An encoder family's model (``invariant_infer.model.encoder``), its linears on
    ``layer_forwards.linear_forward``."""
    if wrapper is not model:
        raise UnsupportedModelError(f"{adapter.model_type}: PEFT adapters on encoders are not supported yet; merge "
                                    "them into the weights (merge_and_unload()) first")
    hub_kernels = _turn_off_hub_kernels(model)
    patcher = patch_modernbert if adapter.layout == "modernbert" else patch_encoder
    hooks, previous_attn = patcher(model, adapter, linear_forward, _set_forward)
    install_generate_refusal(model)
    setattr(model, _STATE_ATTR, ModelPatch(hooks, previous_attn, None, [(install_generate_refusal,
                                                                         remove_generate_refusal)], None, hub_kernels))
    return wrapper


def is_invariant(model: nn.Module) -> bool:
    if is_sentence_transformers_model(model):
        return sentence_transformers_patched(model)
    return getattr(unwrap_peft(model), _STATE_ATTR, None) is not None


def restore(model: nn.Module) -> nn.Module:
    """Return a model patched by ``make_invariant`` to stock transformers behaviour."""
    if is_sentence_transformers_model(model):
        return restore_sentence_transformers(model, restore)
    wrapper, model = model, unwrap_peft(model)
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return wrapper
    for module in model.modules():
        module_patch = remove_state(module)
        if module_patch is None:
            continue
        if module_patch.forward_patched:
            del module.forward
            if module_patch.previous_forward is not None:
                module.forward = module_patch.previous_forward
        if module_patch.refuses_merge:
            del module.merge
    for hook in state.hooks:
        hook.remove()
    if state.reattach_decompression is not None:
        state.reattach_decompression()
    model.set_attn_implementation(state.attn_implementation)
    if state.experts_implementation is not None:
        model.set_experts_implementation(state.experts_implementation)
    for _, remove in reversed(state.extensions):
        remove(model)
    delattr(model, _STATE_ATTR)
    if state.hub_kernels:
        model.set_use_kernels(True)  # as loaded
    return wrapper


@contextlib.contextmanager
def invariant(model: nn.Module):
    """``with invariant(model): ...`` patches for the block and restores afterwards."""
    was_invariant = is_invariant(model)
    make_invariant(model)
    try:
        yield model
    finally:
        if not was_invariant:
            restore(model)
