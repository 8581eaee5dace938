"""Invariant ``model.generate``: ``generate`` (the patched ``generate`` and its checks) and
``sampling`` (seeded per-request sampling whose draws do not depend on the batch)."""
from .generate import generate_invariant, seeded_sampling

__all__ = ["generate_invariant", "seeded_sampling"]
