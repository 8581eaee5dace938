"""Measure the seed's phenomenon: how far a sample's logits move between alone and in a batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .generation import left_pad


@dataclass
class Drift:
    max_abs_diff: float   # max |logit(batch) - logit(alone)| over all real tokens
    rows_unequal: int     # samples whose logits are not bitwise equal
    rows: int


@torch.no_grad()
def batch_drift(model, samples: list[torch.Tensor], progress=None) -> Drift:
    """Run the samples as one left-padded batch and each alone; compare bitwise."""
    device = next(model.parameters()).device
    ids, mask = left_pad(samples)
    batched = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    if progress is not None:
        progress.update(1)
    worst, unequal = 0.0, 0
    for b, s in enumerate(samples):
        alone = model(input_ids=s[None].to(device)).logits[0]
        in_batch = batched[b, ids.shape[1] - len(s):]
        if not torch.equal(alone, in_batch):
            unequal += 1
            worst = max(worst, (alone.float() - in_batch.float()).abs().max().item())
        if progress is not None:
            progress.update(1)
    return Drift(worst, unequal, len(samples))
