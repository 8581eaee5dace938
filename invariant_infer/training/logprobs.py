"""Differentiable per-token logprobs on the invariant kernels, bitwise equal to what the sampler reports.

    model = make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)).train()
    logps = token_logprobs(model, input_ids, attention_mask, temperature=0.7)   # [B, L-1], fp32
    loss = -(logps * advantages[:, None]).sum() / mask.sum(); loss.backward()

``logps[b, t]`` is log p(input_ids[b, t+1] | input_ids[b, :t+1]) under softmax(logits / temperature).
The base model, the lm_head and the logprob kernel are the ones ``score_sequences``, ``generate``
and the engine run, each row reduced alone in a fixed order, so the values are bitwise those the
engine reported for the same tokens (at ``logprobs_mode="processed_logprobs"`` for a temperature
other than 1), whatever the micro-batch split, padding side or packing. The backward runs the
kernels' batch-invariant, deterministic backward passes.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError, NonInvariantInputError
from ..model.families import is_vision_language
from ..model.logits import logit_softcap, token_logprobs_from_hidden_autograd
from ..model.lora import unwrap_peft
from ..model.padding import positions_from_mask
from ..model.patch import is_invariant


def scored_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None) -> torch.Tensor:
    """bool [B, L-1]: whether the token at t + 1 is scored from the context up to t. Not scored: a target
    that is padding, one after padding (the first real token has no context), and the first token of
    a packed sequence (its position id is 0)."""
    b, length = input_ids.shape
    valid = torch.ones((b, length - 1), dtype=torch.bool, device=input_ids.device)
    if attention_mask is not None:
        real = attention_mask.to(torch.bool)
        valid &= real[:, 1:] & real[:, :-1]
    if position_ids is None and attention_mask is not None:
        position_ids = positions_from_mask(attention_mask, length)
    if position_ids is not None:
        valid &= position_ids.expand(b, -1)[:, 1:].to(input_ids.device) != 0
    return valid


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                   **image_inputs) -> torch.Tensor:
    """fp32 [B, L-1] logprobs of each next token at ``temperature``; 0 where nothing is scored
    (``scored_positions``). Differentiable when grad is enabled. ``model`` must be patched by
    ``make_invariant`` (a ``PeftModel`` too: its LoRA adapters run unmerged); padded rows (either side) and
    packed rows (``position_ids`` restarting at 0) both work. A vision-language model takes the rows'
    images as its processor gives them (``pixel_values``, ``image_grid_thw``; ``mm_token_type_ids`` are
    derived when absent), with padded rows; its vision tower must be frozen (its backward is not
    supported yet)."""
    model = unwrap_peft(model)  # a PeftModel: the model inside, its LoRA layers unmerged
    vision = is_vision_language(model.config)
    unknown = set(image_inputs) - ({"pixel_values", "image_grid_thw", "mm_token_type_ids"} if vision else set())
    if unknown:
        raise InvalidArgumentError(f"token_logprobs got unexpected arguments {sorted(unknown)}"
                                   + ("" if vision else " (images: vision-language models only)"))
    if vision and position_ids is not None:
        raise NonInvariantInputError("token_logprobs on a vision-language model takes padded rows (no position_ids): "
                                     "the model computes each row's multimodal positions")
    if not is_invariant(model):
        raise InvalidArgumentError("token_logprobs needs a batch-invariant model: call make_invariant(model) first")
    if not temperature > 0:
        raise InvalidArgumentError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise NonInvariantInputError(f"input_ids must be [batch, length >= 2], got {tuple(input_ids.shape)}")
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, **image_inputs).last_hidden_state
    valid = scored_positions(input_ids, attention_mask, position_ids)
    rows = hidden[:, :-1][valid]
    targets = input_ids[:, 1:][valid]
    # A chunk of rows at a time, each recomputed in the backward: never [tokens x V] logits for autograd.
    values = token_logprobs_from_hidden_autograd(rows, targets, model.get_output_embeddings(), temperature=temperature,
                                                 softcap=logit_softcap(model.config))
    out = torch.zeros(valid.shape, dtype=torch.float32, device=values.device)
    return out.masked_scatter(valid, values)
