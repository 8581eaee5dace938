"""Batch vs alone: how far a sample's logits move when it runs inside a padded batch.

One measurement, used by ``invariant-infer demo``, the tests and the benchmarks. The batch
gets ``position_ids = cumsum(mask) - 1`` by default, as ``generate`` computes them, so a stock
model's padded rows keep the positions they have alone and any difference comes from
reduction order alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..model.padding import pad_sequences, positions_from_mask


@dataclass
class Drift:
    max_abs_diff: float   # max |logit(batch) - logit(alone)| over the real tokens of the checked rows
    rows_unequal: int     # checked rows whose logits are not bitwise equal (torch.equal)
    rows: int             # rows checked
    mismatches: list[tuple[int, float]] = field(default_factory=list)  # (row, max |difference|)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def logits_alone(model, sample: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of one unpadded sample, batch size 1."""
    ids = torch.as_tensor(sample, dtype=torch.long, device=_device(model))[None]
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]


@torch.no_grad()
def logits_in_batch(model, samples: Sequence[torch.Tensor], *, side: str = "left", extra_pad: int = 0,
                    embeds: bool = False, explicit_positions: bool = True) -> list[torch.Tensor]:
    """Each sample's logits [L_i, V] from one forward over the padded batch.

    ``extra_pad`` widens every row beyond the longest; ``embeds`` passes ``inputs_embeds``
    instead of ``input_ids``; ``explicit_positions=False`` leaves position_ids to the model."""
    width = max(len(s) for s in samples) + extra_pad
    ids, mask = pad_sequences(samples, side=side, width=width, device=_device(model))
    kwargs = {"attention_mask": mask}
    if embeds:
        kwargs["inputs_embeds"] = model.get_input_embeddings()(ids)
    else:
        kwargs["input_ids"] = ids
    if explicit_positions:
        kwargs["position_ids"] = positions_from_mask(mask, width)
    logits = model(**kwargs).logits
    starts = [width - len(s) if side == "left" else 0 for s in samples]
    return [logits[b, start:start + len(s)] for b, (start, s) in enumerate(zip(starts, samples))]


def batch_drift(model, samples: Sequence[torch.Tensor], *, side: str = "left", extra_pad: int = 0,
                embeds: bool = False, explicit_positions: bool = True, checked: Sequence[int] | None = None,
                alone: Sequence[torch.Tensor | None] | None = None, progress=None) -> Drift:
    """Run ``samples`` as one padded batch, then each checked row alone; compare bitwise.

    ``checked``: the rows to compare (default all). ``alone``: logits already computed for
    the rows (entries may be None), so callers that try many batchings compute them once.
    ``progress``: a tqdm-like bar, updated once per forward pass."""
    in_batch = logits_in_batch(model, samples, side=side, extra_pad=extra_pad, embeds=embeds,
                               explicit_positions=explicit_positions)
    if progress is not None:
        progress.update(1)
    rows = range(len(samples)) if checked is None else checked
    drift = Drift(0.0, 0, 0)
    for row in rows:
        reference = alone[row] if alone is not None and alone[row] is not None else logits_alone(model, samples[row])
        if progress is not None:
            progress.update(1)
        drift.rows += 1
        got = in_batch[row]
        if not torch.equal(got, reference):
            diff = (got.float() - reference.float()).abs().max().item()
            drift.rows_unequal += 1
            drift.max_abs_diff = max(drift.max_abs_diff, diff)
            drift.mismatches.append((row, diff))
    return drift
