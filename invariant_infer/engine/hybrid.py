"""Hybrid models (Gated DeltaNet layers beside attention) in the engine: how to tell them (what the
engine does not run with them is in the support table, ``invariant_infer.model.support``)."""
from __future__ import annotations


def is_hybrid(config) -> bool:
    return "linear_attention" in (getattr(config, "layer_types", None) or ())
