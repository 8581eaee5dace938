"""Training on the invariant kernels: ``logprobs`` (token logprobs with gradients, the same bits as
the sampler's), ``weight_update`` (new weights into a running engine) and ``integrations/`` (TRL)."""
from .logprobs import scored_positions, token_logprobs

__all__ = ["token_logprobs", "scored_positions"]
