"""Invariant ``model.generate``: ``generate`` (the patched ``generate`` and its checks) and
``sampling`` (seeded per-request sampling whose draws do not depend on the batch)."""
from .generate import generate_invariant, seeded_sampling

__all__ = ["generate_invariant", "seeded_sampling"]


def __getattr__(name: str):
    """Every name of ``generate``, as the module ``invariant_infer.generation`` had them."""
    from . import generate
    try:
        return getattr(generate, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
