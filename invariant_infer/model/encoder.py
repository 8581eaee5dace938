"""Encoders (BERT, XLM-RoBERTa) on the invariant kernels: what ``make_invariant`` checks and patches on
a model of an encoder family (``families.encoder_adapter``).

  * every ``nn.Linear`` -> the invariant linear (the caller's forward, as on decoders);
  * every ``nn.LayerNorm`` -> the one-row-per-reduction ``layer_norm`` kernel;
  * each layer's intermediate activation (exact or tanh GELU) -> the ``gelu`` kernel;
  * self-attention -> the ``invariant_encoder`` attention function, bidirectional: a pre-hook on the base model
    hands it each row's bounds (first real key, end of real keys) with the first query placed past every
    key (``q_start`` = the row width), so every query of a row sees every real key of its row, in KV
    blocks aligned to the row's first real token (the causal kernel run as non-causal, as the vision
    towers run it);
  * positions: each row's own, from its mask (BERT: ``cumsum(mask) - 1``; XLM-R: ``padding_idx`` +
    ``cumsum(mask)``, pads at ``padding_idx``, as it derives them from ``input_ids != padding_idx``);
  * the pooler and XLM-R's classification head take each row's first real token (the first column under
    right padding, as stock; under left padding stock would take a pad) and run tanh as a kernel.
While autograd records (grad enabled, an input or parameter requiring grad), each op runs its
autograd version: the same forward bits, with backward kernels whose per-row gradients (d inputs_embeds,
each row's share of a parameter's gradient) do not depend on the other rows of the batch. Train mode is
refused (``encoder_train_mode``): dropout's draws depend on the batch's shape.
"""
from __future__ import annotations

import contextvars
import functools
import types

import torch
from torch import nn

from . import attention as attention_interface
from ..errors import NonInvariantInputError, UnsupportedModelError
from ..kernels import gelu, gelu_autograd, layer_norm, layer_norm_autograd
from ..kernels.tanh import tanh, tanh_autograd
from .families.encoder_adapter import GELU_FORMS, EncoderAdapter
from .input_checks import bind_forward_arguments
from .kinds import model_kinds
from .packing import FLASH_KWARGS
from .padding import is_sequence_bounds, mask_holes, sequence_bounds
from .support import require
from .tensor_parallel import tp_layout

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Each running call's first real token per row (long [B]), innermost call last: the pooler and the
# classification head read it. Per thread (and asyncio task), so concurrent calls never share it.
_FIRST_TOKENS: contextvars.ContextVar[tuple] = contextvars.ContextVar("invariant_infer_first_tokens", default=())


def base_encoder(model: nn.Module, adapter: EncoderAdapter) -> nn.Module:
    """The base model (``BertModel``): the model itself, or its ``base_model`` under a head."""
    base = model if type(model) is adapter.base else getattr(model, "base_model", None)
    if type(base) is not adapter.base:
        raise UnsupportedModelError(f"{adapter.model_type}: {type(model).__name__} does not hold a "
                                    f"{adapter.base.__name__}")
    return base


def check_encoder_class(model: nn.Module, adapter: EncoderAdapter) -> nn.Module:
    """The checks every encoder layout shares before its own: the class, the support table, the config;
    returns the base model."""
    if type(model) not in adapter.architectures:
        names = ", ".join(cls.__name__ for cls in adapter.architectures)
        raise UnsupportedModelError(f"{adapter.model_type}: {type(model).__name__} is not supported yet; "
                                    f"make_invariant runs {names} (AutoModel, AutoModelForSequenceClassification)")
    kinds = model_kinds(model)
    require(kinds, "model", adapter.model_type)
    if tp_layout(model) is not None:
        require(kinds, "tensor_parallel", adapter.model_type)
    problem = adapter.refuse_config(model.config)
    if problem:
        raise UnsupportedModelError(f"{adapter.model_type}: {problem}")
    return base_encoder(model, adapter)


def check_encoder_modules(model: nn.Module, layer_norm_bias: bool) -> None:
    """Plain Linears, LayerNorms over the last dim with a weight (and a bias where ``layer_norm_bias``),
    dense parameters of a supported dtype on CPU or CUDA."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            raise UnsupportedModelError(f"{name} is {type(module).__name__}; only plain torch.nn.Linear layers are "
                                        "supported on encoders")
        if isinstance(module, nn.LayerNorm) and (type(module) is not nn.LayerNorm or module.weight is None
                                                 or (layer_norm_bias and module.bias is None)
                                                 or len(module.normalized_shape) != 1):
            parts = "weight and bias" if layer_norm_bias else "a weight"
            raise UnsupportedModelError(f"{name}: only a LayerNorm over the last dim with {parts} is supported")
    for name, param in model.named_parameters():
        if param.dtype not in SUPPORTED_DTYPES or param.device.type not in ("cpu", "cuda") \
                or type(param.data) is not torch.Tensor:
            raise UnsupportedModelError(f"parameter {name} is a {param.dtype} {type(param.data).__name__} on "
                                        f"{param.device}; supported: dense {SUPPORTED_DTYPES} tensors on cpu or cuda")


def check_encoder(model: nn.Module, adapter: EncoderAdapter) -> nn.Module:
    """Refuse, by name, what the encoder forwards would not compute exactly; returns the base model."""
    base = check_encoder_class(model, adapter)
    for index, layer in enumerate(base.encoder.layer):
        if type(layer) is not adapter.layer or type(layer.attention.self) is not adapter.self_attention \
                or type(layer.intermediate) is not adapter.intermediate:
            raise UnsupportedModelError(f"{adapter.model_type}: encoder.layer.{index} is not the "
                                        f"{adapter.layer.__name__} layout the adapter patches")
    if base.pooler is not None and type(base.pooler) is not adapter.pooler:
        raise UnsupportedModelError(f"{adapter.model_type}: the pooler is {type(base.pooler).__name__}")
    check_encoder_modules(model, layer_norm_bias=True)
    return base


# ---- per-module forwards ---------------------------------------------------------------------------

def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    if _records_grad(x, self.weight, self.bias):
        return layer_norm_autograd(x, self.weight, self.bias, self.eps)
    return layer_norm(x, self.weight, self.bias, self.eps)


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return gelu_autograd(x, approximate=approximate) if _records_grad(x) else gelu(x, approximate=approximate)


def _tanh(x: torch.Tensor) -> torch.Tensor:
    return tanh_autograd(x) if _records_grad(x) else tanh(x)


def _intermediate_forward(self, hidden_states: torch.Tensor, approximate: str) -> torch.Tensor:
    return _gelu(self.dense(hidden_states), approximate)


def _first_tokens(hidden_states: torch.Tensor) -> torch.Tensor:
    """[B, H]: each row's first real token (the innermost running call's), else the first column."""
    running = _FIRST_TOKENS.get()
    first = running[-1] if running else None
    if first is None or first.shape[0] != hidden_states.shape[0]:
        return hidden_states[:, 0]
    return hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), first]


def _pooler_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _tanh(self.dense(_first_tokens(hidden_states)))


def _classification_head_forward(self, features: torch.Tensor, **kwargs) -> torch.Tensor:
    # Dropout is the identity in eval mode (train mode is refused at the entry).
    return self.out_proj(_tanh(self.dense(_first_tokens(features))))


# ---- input handling ------------------------------------------------------------------------------

def _refuse_training(model: nn.Module) -> None:
    """Train mode is refused (dropout); eval-mode forwards with autograd recording run (see the module)."""
    if model.training:
        recording = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
        require("encoder_train_mode", "training" if recording else "model", type(model).__name__)


def _tokens(kwargs: dict) -> torch.Tensor | None:
    tokens = kwargs.get("input_ids")
    return kwargs.get("inputs_embeds") if tokens is None else tokens


def _padding_mask(kwargs: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The call's 2-D padding mask (all ones when none is given), checked: one run of real tokens per row."""
    mask = kwargs.get("attention_mask")
    if any(kwargs.get(name) is not None for name in FLASH_KWARGS):
        require("encoder_packed_rows", "model")
    if mask is None:
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.shape[-1] > 1 and \
                bool((positions[..., 1:] <= positions[..., :-1]).any()):  # restarting: sequences packed in a row
            require("encoder_packed_rows", "model")
        return torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or is_sequence_bounds(mask):
        raise NonInvariantInputError("encoders take the 2-D padding mask [batch, length]; prepared 4-D masks are not "
                                     "supported")
    if bool(mask_holes(mask).any()):  # the one host read of the call
        raise NonInvariantInputError(
            f"attention_mask rows {mask_holes(mask).nonzero().flatten().tolist()[:8]} have holes; each row must hold "
            "one contiguous run of real tokens, padded on the left or the right")
    return mask


def _set_first_tokens(mask) -> None:
    """This call's first real token per row, from its 2-D mask (None without one: the first column)."""
    first = mask.to(torch.int32).argmax(-1) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    _FIRST_TOKENS.set(_FIRST_TOKENS.get()[:-1] + (first,))


def _entry_pre_hook(module, args, kwargs):
    """On the model the caller calls, above the base model (a classification model); the base model's
    pre-hook checks the mask."""
    _FIRST_TOKENS.set(_FIRST_TOKENS.get() + (None,))  # popped by _exit_hook whatever happens next
    kwargs = bind_forward_arguments(module, args, kwargs)
    _refuse_training(module)
    _set_first_tokens(kwargs.get("attention_mask"))
    return (), kwargs


def _base_pre_hook(module, args, kwargs, padding_idx: int | None):
    """On the base model: each row's positions and attention bounds from its own mask. ``padding_idx``:
    XLM-R's, from which positions count (None: from 0)."""
    _FIRST_TOKENS.set(_FIRST_TOKENS.get() + (None,))
    kwargs = bind_forward_arguments(module, args, kwargs)
    _refuse_training(module)
    tokens = _tokens(kwargs)
    if tokens is None:
        return (), kwargs
    batch, width = tokens.shape[:2]
    mask = _padding_mask(kwargs, tokens)
    if kwargs.get("position_ids") is None:
        count = mask.to(torch.long).cumsum(-1)
        if padding_idx is None:  # from 0, pads at 0
            kwargs["position_ids"] = (count - 1).masked_fill(mask == 0, 0)
        else:  # from padding_idx + 1, pads at padding_idx
            kwargs["position_ids"] = count.masked_fill(mask == 0, 0) + padding_idx
    # The first query sits past every key: each query of a row sees all of its row's real keys.
    kwargs["attention_mask"] = sequence_bounds(mask, batch, width, width, tokens.device)
    _set_first_tokens(mask)
    return (), kwargs


def _exit_hook(module, args, kwargs, output):
    _FIRST_TOKENS.set(_FIRST_TOKENS.get()[:-1])


def _refuse_generate(model, *args, **kwargs):
    require(model_kinds(model), "generate", model.config.model_type)


def install_generate_refusal(model: nn.Module) -> None:
    """``model.generate`` raises the support table's refusal (an encoder's classes have no generate)."""
    model.generate = types.MethodType(_refuse_generate, model)


def remove_generate_refusal(model: nn.Module) -> None:
    model.__dict__.pop("generate", None)


# ---- patching ------------------------------------------------------------------------------------

def patch_encoder(model: nn.Module, adapter: EncoderAdapter, linear_forward, set_forward) -> tuple[list, str]:
    """Check, then patch ``model`` in place; returns (hook handles, the config's attention implementation
    before the patch). ``set_forward(module, fn)`` records each replaced forward for ``restore``."""
    base = check_encoder(model, adapter)
    intermediate = functools.partial(_intermediate_forward, approximate=GELU_FORMS[model.config.hidden_act])
    for module in model.modules():
        if type(module) is nn.Linear:
            set_forward(module, linear_forward)
        elif type(module) is nn.LayerNorm:
            set_forward(module, _layer_norm_forward)
        elif type(module) is adapter.intermediate:
            set_forward(module, intermediate)
        elif type(module) is adapter.pooler:
            set_forward(module, _pooler_forward)
        elif adapter.classification_head is not None and type(module) is adapter.classification_head:
            set_forward(module, _classification_head_forward)
    padding_idx = model.config.pad_token_id if adapter.positions_after_padding_idx else None
    hooks = []
    if model is not base:
        hooks += [model.register_forward_pre_hook(_entry_pre_hook, with_kwargs=True),
                  model.register_forward_hook(_exit_hook, with_kwargs=True, always_call=True)]
    hooks += [base.register_forward_pre_hook(functools.partial(_base_pre_hook, padding_idx=padding_idx),
                                             with_kwargs=True),
              base.register_forward_hook(_exit_hook, with_kwargs=True, always_call=True)]
    attention_interface.register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention_interface.ENCODER_ATTN_IMPLEMENTATION)
    return hooks, previous
