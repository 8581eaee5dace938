"""Helpers for model-level invariance tests: samples, batchings and the bitwise comparison,
all through ``invariant_infer.drift`` (the project's one batch-vs-alone measurement)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from invariant_infer.drift import batch_drift, logits_alone, logits_in_batch


@dataclass(frozen=True)
class Batching:
    members: tuple[int, ...]      # which samples, in which order
    left_pad: bool = True
    extra_pad: int = 0            # padding beyond the longest member
    embeds: bool = False          # inputs_embeds instead of input_ids
    pass_positions: bool = False  # pass position_ids (cumsum - 1) instead of letting them be derived

    def options(self) -> dict:
        return dict(side="left" if self.left_pad else "right", extra_pad=self.extra_pad, embeds=self.embeds,
                    explicit_positions=self.pass_positions)


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


def logits_batched(model, samples, batching: Batching) -> list[torch.Tensor]:
    return logits_in_batch(model, [samples[i] for i in batching.members], **batching.options())


def batch_mismatches(model, samples, batchings=BATCHINGS):
    """Every (batching, sample) whose real-token logits differ from the sample run alone,
    with the max |difference|. Empty means bitwise invariant."""
    alone = [logits_alone(model, s) for s in samples]
    mismatches = []
    for batching in batchings:
        drift = batch_drift(model, [samples[i] for i in batching.members], **batching.options(),
                            alone=[alone[i] for i in batching.members])
        mismatches += [(batching, batching.members[row], diff) for row, diff in drift.mismatches]
    return mismatches
