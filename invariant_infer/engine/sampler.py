"""The engine's sampler: each sampled row's next token, picked as ``sample_next_token`` picks it
(``generate`` and the engine share that function, so a seed gives the same tokens in both).

``pick_alone`` runs ``sample_next_token``'s steps on one row. A row whose token depends on nothing but its logits, its seed and its step (no repetition
penalty) is picked in one pass over the step: greedy rows in one argmax, seeded rows each by
their own unchanged arithmetic, and every token reaches the host in one copy. A row with a
repetition penalty depends on the tokens before it (in a verify step, on the proposals accepted
before it), so it is picked alone when its turn comes.
"""
from __future__ import annotations

import torch

from ..generation.sampling import penalize_repetitions, seeded_scores
from .sequence import Sequence


def picks_alone(seq: Sequence) -> bool:
    """Its pick depends on the tokens before it (a repetition penalty)."""
    return seq.params.repetition_penalty != 1.0


def pick_rows(logits: torch.Tensor, rows: list[tuple[int, Sequence, int]]) -> dict[int, int]:
    """{row: token} for rows ``(row, seq, step)`` whose sequences do not pick alone; ``step``
    counts the sequence's generated tokens before that row's, from 0."""
    greedy = [row for row, seq, _ in rows if seq.params.temperature == 0]
    seeded = [(row, seq, step) for row, seq, step in rows if seq.params.temperature > 0]
    picked = []
    if greedy:  # per row the same first maximum as sample_next_token's
        every_row = len(greedy) == logits.shape[0] and greedy == list(range(len(greedy)))
        picked.append((logits if every_row else logits[greedy]).float().argmax(-1))
    if seeded:
        picked.append(torch.stack([
            seeded_scores(logits[row].float(), seq.seed, step, seq.params.temperature, seq.params.top_k,
                          seq.params.top_p).argmax()
            for row, seq, step in seeded]))
    if not picked:
        return {}
    tokens = (picked[0] if len(picked) == 1 else torch.cat(picked)).tolist()  # the one device-to-host copy
    return dict(zip(greedy + [row for row, _, _ in seeded], tokens))


def pick_alone(seq: Sequence, logits_row: torch.Tensor, step: int, before: list[int]) -> int:
    """The token of one row picked alone (``sample_next_token``'s steps); ``before``: tokens picked
    ahead of it this step."""
    params, scores = seq.params, logits_row.float()
    if params.repetition_penalty != 1.0:
        scores = penalize_repetitions(scores, seq.token_ids + before if before else seq.token_ids,
                                      params.repetition_penalty)
    if params.temperature > 0:
        scores = seeded_scores(scores, seq.seed, step, params.temperature, params.top_k, params.top_p)
    return int(scores.argmax())
