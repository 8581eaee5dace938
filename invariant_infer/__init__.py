"""Bitwise batch-invariant inference for Hugging Face LLMs of fourteen families: the dense Qwen2/Qwen2.5,
Qwen3, Llama 3.x, Mistral and Gemma 3; the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss;
the hybrid (Gated DeltaNet) Qwen3.5, Qwen3.5-MoE and Qwen3-Next text models; the vision-language
Qwen2.5-VL and Qwen3-VL. What runs where: ``invariant_infer.model.support``.

    from invariant_infer import make_invariant, restore
    model = make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval())
"""
from .errors import (InvariantInferError, InvalidArgumentError, InvalidDtypeError, UnsupportedOperationError,
                     KernelLaunchError, UnsupportedModelError, NonInvariantOpError, NonInvariantInputError,
                     TensorParallelError, DeviceError, RequestError, RequestFailedError, EngineBusyError,
                     LoraAdapterError, SpeculativeConfigError, ScoringRequestError, JobError, CheckpointError,
                     CheckpointLoadError, UnsupportedTRLError, InternalError)
from .generation.generate import generate_invariant, seeded_sampling
from .model.audit import AuditReport, audit
from .model.padding import left_pad, pad_sequences, positions_from_mask
from .model.patch import invariant, is_invariant, make_invariant, restore
from .scoring.core import ScoreResult, score_sequences

__all__ = [
    "make_invariant", "restore", "invariant", "is_invariant", "audit", "AuditReport", "positions_from_mask",
    "left_pad", "pad_sequences", "seeded_sampling", "generate_invariant", "score_sequences", "ScoreResult",
    "InvariantInferError", "InvalidArgumentError", "InvalidDtypeError", "UnsupportedOperationError",
    "KernelLaunchError", "UnsupportedModelError", "NonInvariantOpError", "NonInvariantInputError",
    "TensorParallelError", "DeviceError", "RequestError", "RequestFailedError", "EngineBusyError", "LoraAdapterError",
    "SpeculativeConfigError", "ScoringRequestError", "JobError", "CheckpointError", "CheckpointLoadError",
    "UnsupportedTRLError", "InternalError",
]
__version__ = "0.1.0"
