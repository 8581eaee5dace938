"""What ``make_invariant`` keeps on one module it patches: a single ``ModuleState``, which the
module's patched forward reads and ``restore`` removes whole (with the forward it replaced)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

STATE_ATTR = "_invariant_state"


@dataclass
class ModuleState:
    previous_forward: Any = None     # an instance-level forward there before the patch (transformers' TP hooks)
    forward_patched: bool = False    # make_invariant set the module's forward (restore deletes it)
    tensor_parallel: Any = None      # the TPLayout of a module that runs sharded (tensor_parallel.py)
    quantized: Any = None            # the QuantizedLinearPlan / QuantizedExpertsPlan it runs (quantization.py)
    # A quantized linear read as float weights (latent attention's kv_b_proj): its weight dequantized once.
    dequantized_weight: Any = None
    peft_lora: bool = False          # a PEFT LoRA layer adding its adapters' delta unmerged (lora.py)
    refuses_merge: bool = False      # its ``merge`` is the refusal on a quantized base (lora.py)
    adapter_slots: Any = None        # the engine's multi-LoRA SlotWeights on this projection (lora.py)
    rope_tables: tuple | None = None  # a rotary embedding's (cos, sin) tables over every position
    rope_tables_by_type: dict | None = None  # those tables per layer type (Gemma 3's local and global RoPE)
    # Multimodal RoPE (Qwen-VL): which of the (temporal, height, width) positions each frequency takes.
    mrope_axes: Any = None           # long [D / 2]

    @property
    def adds_lora_delta(self) -> bool:
        """A LoRA delta follows the projection: its input must be materialised (no fused prologue)."""
        return self.peft_lora or self.adapter_slots is not None


def state_of(module: nn.Module) -> ModuleState | None:
    """The module's state, or None when ``make_invariant`` did not patch it."""
    return module.__dict__.get(STATE_ATTR)


def module_state(module: nn.Module) -> ModuleState:
    """The module's state, created on first use."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        state = ModuleState()
        module.__dict__[STATE_ATTR] = state
    return state


def remove_state(module: nn.Module) -> ModuleState | None:
    return module.__dict__.pop(STATE_ATTR, None)
