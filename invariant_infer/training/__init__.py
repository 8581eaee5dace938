"""Training on the invariant kernels: ``logprobs`` (token logprobs with gradients, the same bits as
the sampler's), ``weight_update`` (new weights into a running engine) and ``integrations/`` (TRL)."""
from .logprobs import scored_positions, token_logprobs

__all__ = ["token_logprobs", "scored_positions"]


def __getattr__(name: str):
    """Every name of ``logprobs``, as the module ``invariant_infer.training`` had them."""
    from . import logprobs
    try:
        return getattr(logprobs, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
