"""Hybrid models (Gated DeltaNet layers beside attention) in the engine: how to tell them, and what
the engine does not run with them yet."""
from __future__ import annotations

from ..errors import UnsupportedModelError


def is_hybrid(config) -> bool:
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def check_hybrid(model_type: str, kernels: str, speculative, max_loras: int) -> None:
    """Refuse, by name, what the engine does not run with Gated DeltaNet (linear attention) layers."""
    refused = [what for what, asked in (
        ("kernels='stock'", kernels != "invariant"),
        ("speculative decoding (a rejected draft token would have to leave the layers' state)", speculative),
        ("LoRA adapters", max_loras)) if asked]
    if refused:
        raise UnsupportedModelError(f"{model_type}: the engine does not run models with Gated DeltaNet (linear "
                                    f"attention) layers with {'; '.join(refused)} yet")
