"""Helpers for model-level invariance tests: samples, batchings and the bitwise comparison."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from invariant_infer import positions_from_mask


@dataclass(frozen=True)
class Batching:
    members: tuple[int, ...]      # which samples, in which order
    left_pad: bool = True
    extra_pad: int = 0            # padding beyond the longest member
    embeds: bool = False          # inputs_embeds instead of input_ids
    pass_positions: bool = False  # pass position_ids (cumsum - 1) instead of letting them be derived


BATCHINGS = [
    Batching((0, 1, 2, 3)),
    Batching((3, 2, 1, 0), extra_pad=5),
    Batching((2, 0), left_pad=False),
    Batching((1, 3, 2), left_pad=False, extra_pad=3, embeds=True),
    Batching((0, 3), embeds=True, pass_positions=True),
    Batching((3, 0, 1, 2), left_pad=False, pass_positions=True),
]


def make_samples(vocab_size: int, lengths=(9, 1, 14, 5), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


def pad_batch(samples, batching: Batching, pad_id: int = 0):
    rows = [samples[i] for i in batching.members]
    width = max(len(r) for r in rows) + batching.extra_pad
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    spans = []
    for b, r in enumerate(rows):
        start = width - len(r) if batching.left_pad else 0
        ids[b, start:start + len(r)] = r
        mask[b, start:start + len(r)] = 1
        spans.append(slice(start, start + len(r)))
    return ids, mask, spans


@torch.no_grad()
def logits_alone(model, sample: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=sample[None].to(device)).logits[0]


@torch.no_grad()
def logits_batched(model, samples, batching: Batching):
    device = next(model.parameters()).device
    ids, mask, spans = pad_batch(samples, batching)
    ids, mask = ids.to(device), mask.to(device)
    kwargs = {"attention_mask": mask}
    if batching.embeds:
        kwargs["inputs_embeds"] = model.get_input_embeddings()(ids)
    else:
        kwargs["input_ids"] = ids
    if batching.pass_positions:
        kwargs["position_ids"] = positions_from_mask(mask, ids.shape[1])
    logits = model(**kwargs).logits
    return [logits[b, span] for b, span in enumerate(spans)]


def batch_mismatches(model, samples, batchings=BATCHINGS):
    """Every (batching, sample) whose real-token logits differ from the sample run alone,
    with the max |difference|. Empty means bitwise invariant."""
    alone = [logits_alone(model, s) for s in samples]
    mismatches = []
    for batching in batchings:
        for member, got in zip(batching.members, logits_batched(model, samples, batching)):
            if not torch.equal(got, alone[member]):
                diff = (got.float() - alone[member].float()).abs().max().item()
                mismatches.append((batching, member, diff))
    return mismatches
