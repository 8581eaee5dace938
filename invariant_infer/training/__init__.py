"""Training on the invariant kernels: ``logprobs`` (token logprobs with gradients, the same bits as
the sampler's), ``weight_update`` (new weights into a running engine) and ``integrations/`` (TRL)."""
from .._legacy_names import names_of
from . import logprobs
from .logprobs import scored_positions, token_logprobs

__all__ = ["token_logprobs", "scored_positions"]

__getattr__ = names_of(logprobs, __name__)  # every name of logprobs, as invariant_infer.training had them
