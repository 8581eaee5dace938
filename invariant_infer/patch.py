"""``make_invariant(model)``: patch one loaded Qwen2/Qwen2.5 model in place, per instance.

What changes (and nothing process-wide):
  * every ``nn.Linear`` (q/k/v with bias, o, gate/up/down, lm_head) -> fixed-order Triton linear;
  * every ``Qwen2RMSNorm`` -> one-row-per-program Triton RMSNorm;
  * every ``Qwen2MLP`` -> same projections, with silu(gate) * up fused into the down projection;
  * the rotary embedding -> lookup in a cos/sin table computed once per model;
  * attention -> the ``invariant`` attention and mask functions (see ``hf_attention``);
  * a pre-forward hook on the base model derives ``position_ids`` from the mask
    (cumsum - 1, pads at 0) and rejects masks that cannot be invariant;
  * ``model.generate`` (this instance only) first rejects options that are not batch-invariant
    (see ``generation``).
``restore(model)`` undoes all of it.
"""
from __future__ import annotations

import contextlib
import inspect
import types
import warnings

import torch
from torch import nn

from . import hf_attention
from .errors import NonInvariantInputError, UnsupportedModelError
from .generation import install_generate_checks, remove_generate_checks
from .kernels import linear, rms_norm
from .kernels.fused_linear import silu_mul_linear

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_DEVICES = ("cpu", "cuda")
# RoPE types whose frequencies do not depend on the sequence length (dynamic/longrope do).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
_STATE_ATTR = "_invariant_infer_state"


# ---- per-module forwards -------------------------------------------------------------------------

def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # silu(gate) * up is computed inside the down projection's prologue: bitwise what
    # down_proj(silu_mul(gate, up)) gives, without writing the [tokens x intermediate] product.
    down = self.down_proj
    return silu_mul_linear(self.gate_proj(x), self.up_proj(x), down.weight, down.bias)


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    cos_table, sin_table = self._invariant_tables
    if cos_table.device != x.device:
        cos_table, sin_table = cos_table.to(x.device), sin_table.to(x.device)
        self._invariant_tables = (cos_table, sin_table)
    idx = position_ids.clamp(0, cos_table.shape[0] - 1)  # range is checked eagerly in the pre-hook
    return cos_table[idx].to(x.dtype), sin_table[idx].to(x.dtype)


def _rope_tables(rotary: nn.Module, max_positions: int):
    """cos/sin for every position, computed once with HF's own formula, so that a position's
    values never depend on where it sits in a batch (elementwise kernels on CPU differ between
    vectorized bodies and scalar tails)."""
    inv_freq = rotary.inv_freq.float()
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = getattr(rotary, "attention_scaling", 1.0)
    return emb.cos() * scaling, emb.sin() * scaling


# ---- input handling ------------------------------------------------------------------------------

def positions_from_mask(attention_mask: torch.Tensor, query_length: int) -> torch.Tensor:
    """position_ids for the last ``query_length`` columns: cumsum(mask) - 1, pads at 0."""
    mask = attention_mask.to(torch.long)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return positions[:, -query_length:]


def _mask_holes(mask: torch.Tensor) -> torch.Tensor:
    """bool [B]: rows whose ones are not one contiguous run."""
    mask = mask.to(torch.int32)
    count = mask.sum(-1)
    first = mask.argmax(-1)
    last = mask.shape[-1] - 1 - mask.flip(-1).argmax(-1)
    return (count > 0) & (last - first + 1 != count)


def _holes_error(holes: torch.Tensor) -> NonInvariantInputError:
    rows = holes.nonzero().flatten().tolist()
    return NonInvariantInputError(
        f"attention_mask rows {rows[:8]} have holes (their ones are not contiguous). Invariant inference "
        "supports left or right padding around one contiguous run of real tokens per row. In generation, "
        "pad prompts on the left (tokenizer.padding_side = 'left').")


_FORWARD_NAMES: dict[type, list[str]] = {}


def _base_forward_names(module: nn.Module) -> list[str]:
    """Parameter names of the base model's forward, to bind positional arguments (once per class)."""
    cls = type(module)
    if cls not in _FORWARD_NAMES:
        _FORWARD_NAMES[cls] = [n for n in inspect.signature(cls.forward).parameters if n != "self"]
    return _FORWARD_NAMES[cls]


def _cache_length(kwargs) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


def _base_pre_hook(module, args, kwargs):
    kwargs = {**dict(zip(_base_forward_names(module), args)), **kwargs}
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        raise NonInvariantInputError("4-D attention masks are not supported; pass the 2-D padding mask")
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        return (), kwargs
    query_length = tokens.shape[1]
    limit = module.rotary_emb._invariant_tables[0].shape[0]
    has_mask = isinstance(mask, torch.Tensor) and mask.dim() == 2
    given = kwargs.get("position_ids")
    if has_mask and given is None:
        kwargs["position_ids"] = positions_from_mask(mask, query_length)
    if torch.compiler.is_compiling():  # checks below sync with the host; generate() validated up front
        return (), kwargs
    if torch.is_grad_enabled() and module.embed_tokens.weight.requires_grad:
        warnings.warn("invariant kernels are inference-only: their outputs carry no gradient, so a backward pass "
                      "would see only the residual paths. Run under torch.no_grad() or torch.inference_mode().",
                      stacklevel=3)
    positions = kwargs.get("position_ids")
    if positions is None:  # HF will use arange(past, past + L)
        total = _cache_length(kwargs) + query_length
        if total > limit:
            raise NonInvariantInputError(f"sequence of {total} positions is longer than max_position_embeddings "
                                         f"({limit})")
        return (), kwargs
    if has_mask:
        real = mask[:, -query_length:].to(torch.bool)
        positions = positions.expand(real.shape[0], -1)
        flags = torch.stack([_mask_holes(mask).any(),
                             (positions[real] < 0).any() | (positions[real] >= limit).any(),
                             (positions[real] != positions_from_mask(mask, query_length)[real]).any()])
    else:
        flags = torch.stack([torch.zeros((), dtype=torch.bool, device=positions.device),
                             (positions < 0).any() | (positions >= limit).any(),
                             torch.zeros((), dtype=torch.bool, device=positions.device)])
    holes, out_of_range, disagree = flags.tolist()  # one host sync for all checks
    if holes:
        raise _holes_error(_mask_holes(mask))
    if out_of_range:
        raise NonInvariantInputError(f"position ids of real tokens must lie in [0, {limit}) "
                                     "(max_position_embeddings)")
    if disagree and given is not None:
        # Honoured, as in stock HF; but the rows cannot then match the same samples run alone.
        warnings.warn("position_ids do not equal cumsum(attention_mask) - 1 on real tokens; padded rows will not "
                      "match the same samples run alone. Omit position_ids to have them derived from the mask.",
                      stacklevel=3)
    return (), kwargs


# ---- checks ----------------------------------------------------------------------------------------

def _base_model(model: nn.Module) -> nn.Module:
    base = getattr(model, "model", model)
    if not (hasattr(base, "layers") and hasattr(base, "rotary_emb") and hasattr(base, "norm")):
        raise UnsupportedModelError(f"{type(model).__name__} does not have the Qwen2 layout (model.layers, "
                                    "model.norm, model.rotary_emb)")
    return base


def _check_model(model: nn.Module) -> nn.Module:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type != "qwen2":
        raise UnsupportedModelError(
            f"make_invariant supports Hugging Face Qwen2/Qwen2.5 models (config.model_type == 'qwen2'); got "
            f"{type(model).__name__} with model_type {model_type!r}")
    base = _base_model(model)
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise UnsupportedModelError("sliding-window attention layers are not supported; set use_sliding_window=False")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"only the silu MLP is supported, config.hidden_act={config.hidden_act!r}")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} rescales with sequence length, which depends on "
                                    f"the batch; supported: {STATIC_ROPE_TYPES}")
    if getattr(config, "quantization_config", None) is not None or getattr(model, "hf_quantizer", None):
        raise UnsupportedModelError("quantized models are not supported: projections must be plain nn.Linear "
                                    f"in {SUPPORTED_DTYPES}")
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj,
                       "gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj, "down_proj": mlp.down_proj}
        for name, proj in projections.items():
            if type(proj) is not nn.Linear:
                raise UnsupportedModelError(
                    f"{name} is {type(proj).__module__}.{type(proj).__name__}; only plain torch.nn.Linear "
                    "projections are supported (no quantized or adapter layers; merge LoRA first)")
    for name, module in model.named_modules():  # lm_head, score heads, anything Linear-like
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            raise UnsupportedModelError(
                f"{name or 'model'} is {type(module).__module__}.{type(module).__name__}; only plain "
                "torch.nn.Linear layers are supported (no quantized or adapter layers; merge LoRA first)")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and type(head) is not nn.Linear:
        raise UnsupportedModelError(f"lm_head is {type(head).__name__}; only a plain torch.nn.Linear is supported")
    for name, param in model.named_parameters():
        if param.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedModelError(f"parameter {name} has dtype {param.dtype}; supported: {SUPPORTED_DTYPES}")
        if param.device.type not in SUPPORTED_DEVICES:
            raise UnsupportedModelError(f"parameter {name} is on {param.device}; supported devices: "
                                        f"{SUPPORTED_DEVICES}")
        if type(param.data) is not torch.Tensor:
            raise UnsupportedModelError(f"parameter {name} is a {type(param.data).__name__}; only dense tensors "
                                        "are supported")
    return base


# ---- public API -------------------------------------------------------------------------------------

def _set_forward(module: nn.Module, fn, patched: list) -> None:
    module.forward = types.MethodType(fn, module)
    patched.append(module)


def make_invariant(model: nn.Module) -> nn.Module:
    """Patch a loaded Qwen2/Qwen2.5 model in place so its logits are bitwise batch-invariant.

    Returns the same model. Idempotent. Undo with ``restore(model)``."""
    if getattr(model, _STATE_ATTR, None) is not None:
        return model
    base = _check_model(model)
    hf_attention.register()

    patched: list = []
    for module in model.modules():
        if type(module) is nn.Linear:
            _set_forward(module, _linear_forward, patched)
        elif type(module).__name__ == "Qwen2RMSNorm":
            _set_forward(module, _rms_norm_forward, patched)
        elif type(module).__name__ == "Qwen2MLP":
            _set_forward(module, _mlp_forward, patched)

    rotary = base.rotary_emb
    rotary._invariant_tables = _rope_tables(rotary, model.config.max_position_embeddings)
    _set_forward(rotary, _rotary_forward, patched)

    hook = base.register_forward_pre_hook(_base_pre_hook, with_kwargs=True)
    previous_attn = model.config._attn_implementation
    model.set_attn_implementation(hf_attention.ATTN_IMPLEMENTATION)
    if hasattr(model, "generate"):
        install_generate_checks(model)
    setattr(model, _STATE_ATTR, {"patched": patched, "hook": hook, "attn": previous_attn, "rotary": rotary})
    return model


def is_invariant(model: nn.Module) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None


def restore(model: nn.Module) -> nn.Module:
    """Return a model patched by ``make_invariant`` to stock transformers behaviour."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return model
    for module in state["patched"]:
        del module.forward
    state["hook"].remove()
    del state["rotary"]._invariant_tables
    model.set_attn_implementation(state["attn"])
    remove_generate_checks(model)
    delattr(model, _STATE_ATTR)
    return model


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
