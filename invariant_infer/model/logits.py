"""The lm_head on hidden rows, and per-token logprobs from it a chunk of rows at a time.

Only [chunk_rows x V] logits, in the model dtype, exist at a time: a long batch never holds
[tokens x V] logits. The chunk size changes no bit: the linear kernel is M-invariant and the
logprob kernel reduces each row alone. ``head``: a module that turns rows into logits in place of
``linear(rows, weight, bias)`` (a tensor-parallel lm_head's own forward: its vocabulary slice, then
an all-gather; or, for training, the wrapped lm_head with its autograd).

Used by the engine (``head_logits``), scoring (``token_logprobs_from_hidden``) and training
(``token_logprobs_from_hidden_autograd``).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..kernels import linear, token_logprobs, token_logprobs_autograd
from ..kernels.tanh import tanh, tanh_autograd

# Elements of one logits chunk: 32 Mi (64 MiB in bf16); a Qwen2.5 vocab gives 220 rows a chunk.
LOGITS_CHUNK_ELEMENTS = 1 << 25


def logits_chunk_rows(vocab_size: int, chunk_rows: int | None = None) -> int:
    """Rows per logits chunk: ``chunk_rows``, or as many as ``LOGITS_CHUNK_ELEMENTS`` holds."""
    return chunk_rows if chunk_rows is not None else max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)


def head_logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                head=None, invariant: bool = True, softcap: float | None = None) -> torch.Tensor:
    """Logits [R, V] (model dtype) of hidden rows [R, H]: ``head(rows)`` when a head module is given,
    else the invariant linear kernel (``invariant=False``: torch's, for stock benchmarks); then
    ``softcap_logits`` where the model caps its logits."""
    if head is not None:
        logits = head(rows)
    elif invariant:
        logits = linear(rows, weight, bias)
    else:
        logits = F.linear(rows, weight, bias)
    return logits if softcap is None else softcap_logits(logits, softcap)


def softcap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma's final logit softcapping) in transformers' three roundings,
    each element alone: the divide and multiply are exact per element, tanh is a kernel."""
    scaled = logits / cap
    capped = tanh_autograd(scaled) if torch.is_grad_enabled() and scaled.requires_grad else tanh(scaled)
    return capped * cap


def logit_softcap(config) -> float | None:
    """The cap a causal LM's config applies to its final logits (Gemma 4), or None."""
    text = getattr(config, "text_config", None) or config
    return getattr(text, "final_logit_softcapping", None)


def _chunks(total: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, chunk_rows):
        yield start, min(start + chunk_rows, total)


def token_logprobs_from_hidden(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, *,
                               lm_head_bias: torch.Tensor | None = None, chunk_rows: int | None = None,
                               head=None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states [T, H] and the tokens they predict [T] -> (fp32 [T] logprobs, bool [T]
    is-argmax), a chunk of rows at a time (see the module's docstring)."""
    chunk_rows = logits_chunk_rows(lm_head_weight.shape[0], chunk_rows)
    total = hidden.shape[0]
    logprobs = torch.empty(total, device=hidden.device, dtype=torch.float32)
    is_argmax = torch.empty(total, device=hidden.device, dtype=torch.bool)
    for start, end in _chunks(total, chunk_rows):
        logits = head_logits(hidden[start:end], lm_head_weight, lm_head_bias, head=head, softcap=softcap)
        logprobs[start:end], is_argmax[start:end] = token_logprobs(logits, targets[start:end])
        del logits
    return logprobs, is_argmax


def _head_logprobs(rows: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float,
                   softcap: float | None = None):
    logits = head(rows)
    return token_logprobs_autograd(logits if softcap is None else softcap_logits(logits, softcap), targets, temperature)


def token_logprobs_from_hidden_autograd(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, *,
                                        temperature: float = 1.0, chunk_rows: int | None = None,
                                        softcap: float | None = None) -> torch.Tensor:
    """fp32 [T] logprobs of ``targets`` under softmax(head(hidden) / temperature) (the logits softcapped
    first where ``softcap`` is given), differentiable.
    With grad, each chunk's head and logprobs are recomputed in the backward (same kernels, same
    bits), so only one chunk's logits live at a time for autograd too."""
    chunk_rows = logits_chunk_rows(head.weight.shape[0], chunk_rows)
    differentiable = torch.is_grad_enabled() and hidden.requires_grad
    pieces = []
    for start, end in _chunks(hidden.shape[0], chunk_rows):
        part, part_targets = hidden[start:end], targets[start:end]
        if differentiable:
            pieces.append(checkpoint(_head_logprobs, part, part_targets, head, temperature, softcap,
                                     use_reentrant=False))
        else:
            pieces.append(_head_logprobs(part, part_targets, head, temperature, softcap))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
