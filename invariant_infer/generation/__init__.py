"""Invariant ``model.generate``: ``generate`` (the patched ``generate`` and its checks) and
``sampling`` (seeded per-request sampling whose draws do not depend on the batch)."""
from .._legacy_names import names_of
from . import generate
from .generate import generate_invariant, seeded_sampling

__all__ = ["generate_invariant", "seeded_sampling"]

__getattr__ = names_of(generate, __name__)  # every name of generate, as invariant_infer.generation had them
