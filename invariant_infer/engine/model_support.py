"""What the engine runs, asked of the support table before it builds anything: the model's kinds, with
the engine's adapter slots (``lora``) and ``kernels='stock'``, on the engine, speculative decoding and
tensor parallelism."""
from __future__ import annotations

from ..model.kinds import model_kinds
from ..model.support import require


def check_engine_support(model, kernels: str, speculative, max_loras: int, tensor_parallel_size: int) -> None:
    """Raise the table's error for the first surface the engine's options ask for that the model's kinds
    do not run on."""
    kinds = model_kinds(model) | ({"lora"} if max_loras else set()) | \
        ({"stock_kernels"} if kernels != "invariant" else set())
    subject = getattr(model.config, "model_type", None)
    if speculative:  # first: what speculation refuses is named as such, even where the engine refuses it too
        require(kinds, "speculative", subject)
    require(kinds, "engine", subject)
    if tensor_parallel_size > 1:
        require(kinds, "tensor_parallel", subject)
