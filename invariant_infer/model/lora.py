"""LoRA adapters on the invariant kernels, unmerged: ``base(x) + scaling * B(A(x))``.

Two holders of adapter weights run the same arithmetic (``add_lora_delta``), so their bits agree:
  * a PEFT ``PeftModel`` (``peft.tuners.lora.Linear`` layers): ``make_invariant(peft_model)`` patches
    the Hugging Face model inside it, and each LoRA layer runs ``peft_lora_forward``: its base layer
    (the patched ``nn.Linear``), then for each active adapter ``x -> A -> B`` on the invariant linear
    kernel, times the adapter's scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA),
    added in PEFT's own order and dtypes (PEFT keeps 16-bit models' adapters in fp32; ``x`` is cast
    to the adapter's dtype, the sum is cast back);
  * adapter slots (``SlotWeights``), which the multi-LoRA engine attaches to a patched model's
    projections: each row runs the adapter of its own request, and the rows of one adapter go
    through the kernels together. The kernels see each adapter at its own rank (a slot's view
    ``A[:r]``, ``B[:, :r]``), so slots, neighbours and the slot's rank padding never enter a reduction.
The linear kernel's reduction order depends on the weight shape alone, never on M, so a row's LoRA
output does not depend on how many rows share its adapter (``shrink_config`` is where a
rows-dependent split would enter; the tests replace it to show that the invariance checks catch one).
QLoRA: a base layer may be a compressed-tensors quantized layer or transformers' ``FP8Linear`` (its
``fp8`` format); it runs its quantized GEMM and, in training, passes the input gradient through its
frozen weight (``kernels.quantized_linear_autograd``).

Refused with the reason: other PEFT tuners, DoRA and the other LoRA variants, LoRA biases, LoRA on the
lm_head or embeddings, LoRA on latent attention's kv_b_proj (read absorbed, never called), a
``PeftModel`` on a tensor-parallel base (the engine's slots serve one), and ``lora_dropout > 0`` in
train mode (its random mask is drawn for the whole batch).
``merge_and_unload()`` still works: it folds ``scaling * B @ A`` into each base weight (rounded to the
weight's dtype), so the merged model's bits differ from the unmerged adapter's, as they do in PEFT.
"""
from __future__ import annotations

import sys
import types

import torch
from torch import nn

from ..errors import NonInvariantInputError, UnsupportedModelError
from ..kernels import linear, linear_autograd
from ..kernels.configs import linear_config
from .latent_attention import KV_B_LORA_REASON
from .module_state import module_state, state_of
from .step_context import current_step
from .support import require
from .tensor_parallel import gather_columns, lora_layout

REFUSED_OPTIONS = {  # LoraConfig field -> why
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported; use plain LoRA or merge_and_unload()",
    "lora_bias": "LoRA biases (lora_bias=True) are not supported",
    "use_qalora": "QA-LoRA is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "trainable_token_indices": "trainable token indices are not supported",
}


def _peft():
    return sys.modules.get("peft")  # a PEFT model exists only if peft was imported


def is_peft_model(model) -> bool:
    peft = _peft()
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a ``PeftModel`` (the model itself otherwise)."""
    return model.get_base_model() if is_peft_model(model) else model


def is_peft_lora_layer(module) -> bool:
    peft = _peft()
    return peft is not None and isinstance(module, peft.tuners.lora.LoraLayer)


def has_unpatched_lora(model: nn.Module) -> bool:
    """Whether PEFT LoRA layers were added to a model after ``make_invariant`` patched it."""
    return any(is_peft_lora_layer(module) and not getattr(state_of(module), "peft_lora", False)
               for module in model.modules())


def base_linear(module):
    """The layer that holds a projection's base weight: a LoRA layer's base layer, a
    ``modules_to_save`` wrapper's original module, else the module itself."""
    peft = _peft()
    if peft is None or module is None:
        return module
    if isinstance(module, peft.tuners.lora.LoraLayer):
        return module.base_layer
    if isinstance(module, peft.utils.other.AuxiliaryTrainingWrapper):
        return module.original_module
    return module


def check_peft(model: nn.Module) -> None:
    """Refuse, by name, the PEFT configurations that this module does not run."""
    if not is_peft_model(model):
        if type(model).__module__.startswith("peft."):
            raise UnsupportedModelError(f"{type(model).__name__} is not supported; wrap the model with "
                                        "peft.get_peft_model or PeftModel.from_pretrained (LoRA)")
        return
    for name, config in model.peft_config.items():
        tuner = getattr(config.peft_type, "value", config.peft_type)
        if tuner != "LORA":
            raise UnsupportedModelError(f"adapter {name!r} is a PEFT {tuner} adapter; only LoRA is supported")
        for option, why in REFUSED_OPTIONS.items():
            if getattr(config, option, None):
                raise UnsupportedModelError(f"adapter {name!r}: {why}")


def lora_layers(model: nn.Module, head: nn.Module | None, quantized, sharded: bool,
                absorbed: set = frozenset()) -> list[nn.Module]:
    """The PEFT LoRA layers of a (patched-to-be) Hugging Face model, checked; ``absorbed``: projections
    read as weights and never called (latent attention's kv_b_proj), which no LoRA may wrap."""
    peft = _peft()
    if peft is None:
        return []
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer):
            continue
        if type(module) is not peft.tuners.lora.Linear or (type(module.base_layer) is not nn.Linear
                                                          and module.base_layer not in quantized):
            raise UnsupportedModelError(f"{name}: LoRA on a {type(module.base_layer).__name__} is not supported "
                                        "(LoRA on the linear projections only)")
        if module is head or module.base_layer is head:
            raise UnsupportedModelError(f"{name}: LoRA on the lm_head is not supported (logits are computed from "
                                        "its weight in chunks); use modules_to_save=['lm_head'] or merge it")
        if module in absorbed or module.base_layer in absorbed:
            raise UnsupportedModelError(f"{name}: {KV_B_LORA_REASON}")
        if module.lora_variant:
            raise UnsupportedModelError(f"{name}: LoRA variants ({', '.join(module.lora_variant)}: "
                                        f"{type(next(iter(module.lora_variant.values()))).__name__}) are not supported")
        if sharded:
            require("peft_model", "tensor_parallel")
        found.append(module)
    return found


def refuse_quantized_merge(layer, quantized) -> None:
    """Merging into a compressed base weight is refused by name (PEFT would fail on it, or its
    merged weight would not be the one the quantized GEMM reads). ``restore`` removes the refusal."""
    if layer.base_layer in quantized:
        layer.merge = types.MethodType(_refused_merge, layer)
        module_state(layer).refuses_merge = True


def _refused_merge(self, *args, **kwargs):
    raise UnsupportedModelError("merging a LoRA adapter into a quantized base layer is not supported (its weight "
                                "stays compressed): keep the adapter unmerged, or merge on a dense base")


# ---- the arithmetic ---------------------------------------------------------------------------------

def shrink_config(device_type: str, dtype: torch.dtype, rows: int, rank: int, k: int):
    """The shrink's (x @ A^T) tile config: None, the per-shape table's. Never a function of ``rows``."""
    return None


def _lora_linear(x: torch.Tensor, weight: torch.Tensor, config=None) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return linear_autograd(x, weight, config=config)
    return linear(x, weight, config=config)


def add_lora_delta(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scaling: float, expand_config=None) -> torch.Tensor:
    """``out + B(A(x)) * scaling``, as PEFT writes it: x cast to the adapter's dtype, the sum in the
    promoted dtype (the caller casts back). Every op is per row, so a row's result is its own.
    ``expand_config``: the tile config of the whole B, for a rank that holds some of its rows."""
    x = x if x.dtype == a.dtype else x.to(a.dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    shrunk = _lora_linear(x, a, shrink_config(x.device.type, x.dtype, rows, a.shape[0], a.shape[1]))
    return out + _lora_linear(shrunk, b, expand_config) * scaling


def _refuse_train_dropout(layer, adapter: str) -> None:
    dropout = layer.lora_dropout[adapter]
    if layer.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
        raise NonInvariantInputError(
            f"adapter {adapter!r} has lora_dropout={dropout.p} and the model is in train mode: the dropout mask is "
            "drawn for the whole batch, so a sample's numbers would depend on its batch. Use lora_dropout=0.0 "
            "or call model.eval().")


def peft_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT ``lora.Linear`` forward on the invariant kernels (PEFT's own order of operations)."""
    if args or kwargs:
        raise NonInvariantInputError(f"LoRA layers take no extra forward arguments here (got "
                                     f"{sorted(kwargs) or len(args)}); per-row adapters run in the engine")
    if self.disable_adapters and self.merged:
        self.unmerge()
    result = self.base_layer(x)
    if self.disable_adapters or self.merged:
        return result
    dtype = result.dtype
    for adapter in self.active_adapters:
        if adapter not in self.lora_A:
            continue
        _refuse_train_dropout(self, adapter)
        result = add_lora_delta(result, x, self.lora_A[adapter].weight, self.lora_B[adapter].weight,
                                self.scaling[adapter])
    return result.to(dtype)


# ---- adapter slots (the multi-LoRA engine) ------------------------------------------------------------

class SlotWeights:
    """One projection's adapter slots: A [slots, max_rank, K] and B [slots, N, max_rank] allocated
    once; slot s holds an adapter of rank r (0: none) in ``A[s, :r]`` and ``B[s, :, :r]``.

    On a tensor-parallel projection (``tensor_parallel.lora_layout``) each rank runs the arithmetic
    of one process: a column-parallel one keeps its rows of B (its output shard) and expands with the
    full B's tile config; a row-parallel one keeps A and B whole and gathers its input's K shards
    (copies) before the shrink, so every rank adds the one-process delta to the exchanged output.

    Which rows run which slot is the engine step's (``step_context.StepContext.lora_groups``); outside
    a step every row runs the base layer alone."""

    def __init__(self, layer: nn.Linear, slots: int, max_rank: int, dtype: torch.dtype):
        self.n, self.k = layer.out_features, layer.in_features  # a quantized layer's weight is compressed
        device = layer.weight_scale.device if hasattr(layer, "weight_scale") else layer.weight.device
        self.base_forward = layer.__dict__["forward"]
        state = state_of(layer)
        if state.tensor_parallel is not None and state.quantized is not None:
            require(("quantized", "lora"), "tensor_parallel")
        self.layout, self.columns_sharded = lora_layout(layer)
        n = layer.weight.to_local().shape[0] if self.columns_sharded else self.n  # this rank's output shard
        self.a = torch.zeros((slots, max_rank, self.k), dtype=dtype, device=device)
        self.b = torch.zeros((slots, n, max_rank), dtype=dtype, device=device)
        self.ranks, self.scalings = [0] * slots, [0.0] * slots

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        if a is None:
            self.ranks[slot] = 0
            return
        rank = a.shape[0]
        if self.columns_sharded:  # DTensor's Shard(0): torch.chunk's rows
            b = b.chunk(self.layout.size)[self.layout.rank]
        self.a[slot, :rank].copy_(a)
        self.b[slot, :, :rank].copy_(b)
        self.ranks[slot], self.scalings[slot] = rank, scaling

    @staticmethod
    def step_groups() -> tuple[tuple[int, torch.Tensor], ...]:
        """(slot, long row indices into the flattened tokens) of the running engine step, else none."""
        step = current_step()
        return step.lora_groups if step is not None else ()

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        groups = self.step_groups()
        if not any(self.ranks[slot] for slot, _ in groups):  # the same on every rank
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        if self.layout is not None and not self.columns_sharded:
            x2 = gather_columns(x2, self.layout)  # the whole K: the shrink reduces it as one process does
        for slot, rows in groups:
            rank = self.ranks[slot]
            if rank:
                expand = linear_config(x.device.type, self.a.dtype, self.n, rank) if self.columns_sharded else None
                delta = add_lora_delta(out2[rows], x2[rows], self.a[slot, :rank], self.b[slot, :, :rank],
                                       self.scalings[slot], expand)
                out2.index_copy_(0, rows, delta.to(out2.dtype))
        return out


def _slot_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    slots = state_of(self).adapter_slots
    return slots.apply(slots.base_forward(x), x)


def attach_slots(layer: nn.Linear, slots: int, max_rank: int, dtype: torch.dtype) -> SlotWeights:
    """Give a patched projection adapter slots (its forward: the patched one, then each row's adapter)."""
    if "forward" not in layer.__dict__ or not isinstance(layer, nn.Linear):
        raise UnsupportedModelError("adapter slots go on the nn.Linear projections of a make_invariant model")
    weights = SlotWeights(layer, slots, max_rank, dtype)
    module_state(layer).adapter_slots = weights
    layer.forward = _slot_linear_forward.__get__(layer)
    return weights


def detach_slots(layer: nn.Linear) -> None:
    state = state_of(layer)
    weights = state.adapter_slots if state is not None else None
    if weights is not None:
        state.adapter_slots = None
        layer.forward = weights.base_forward
