"""The engine's sampler: each sampled row's next token, picked as ``sample_next_token`` picks it
(``generate`` and the engine share the seeded arithmetic, so a seed gives the same tokens in both).

A row whose token depends on nothing but its logits, its seed and its step (no repetition penalty)
is picked in one pass over the step: greedy rows in one argmax, seeded rows in one batched
``seeded_scores_rows`` (row-local: each row's sample is what it gets alone), and every token
reaches the host in one copy, however many rows the step samples. A row with a repetition penalty
depends on the tokens before it (in a verify step, on the proposals accepted before it), so it is
picked alone when its turn comes: one host read per such row.

``suppressed``: token ids never sampled (their logits set to -inf in a copy before picking, each row
alone); the engine passes ``EngineCore.suppressed_token_ids``. Logprobs are taken from the logits as
the model gave them, so suppression changes no reported logprob.
"""
from __future__ import annotations

from collections.abc import Sequence as Ids

import torch

from ..generation.sampling import penalize_repetitions, seeded_scores_rows, suppress_tokens
from .sequence import Sequence


def picks_alone(seq: Sequence) -> bool:
    """Its pick depends on the tokens before it (a repetition penalty)."""
    return seq.params.repetition_penalty != 1.0


def seeded_rows(scores: torch.Tensor, rows: list[tuple[Sequence, int]]) -> torch.Tensor:
    """``seeded_scores_rows`` of scores [R, V] for rows ``(seq, step)``, with each sequence's parameters."""
    return seeded_scores_rows(scores, [seq.seed for seq, _ in rows], [step for _, step in rows],
                              [seq.params.temperature for seq, _ in rows], [seq.params.top_k for seq, _ in rows],
                              [seq.params.top_p for seq, _ in rows])


def pick_rows(logits: torch.Tensor, rows: list[tuple[int, Sequence, int]], suppressed: Ids[int] = ()) -> dict[int, int]:
    """{row: token} for rows ``(row, seq, step)`` whose sequences do not pick alone; ``step``
    counts the sequence's generated tokens before that row's, from 0."""
    greedy = [row for row, seq, _ in rows if seq.params.temperature == 0]
    seeded = [(row, seq, step) for row, seq, step in rows if seq.params.temperature > 0]
    picked = []
    if greedy:  # per row the same first maximum as sample_next_token's
        every_row = len(greedy) == logits.shape[0] and greedy == list(range(len(greedy)))
        picked.append(suppress_tokens((logits if every_row else logits[greedy]).float(), suppressed).argmax(-1))
    if seeded:
        scores = suppress_tokens(logits[[row for row, _, _ in seeded]].float(), suppressed)
        picked.append(seeded_rows(scores, [(seq, step) for _, seq, step in seeded]).argmax(-1))
    if not picked:
        return {}
    tokens = (picked[0] if len(picked) == 1 else torch.cat(picked)).tolist()  # the one device-to-host copy
    return dict(zip(greedy + [row for row, _, _ in seeded], tokens))


def pick_alone(seq: Sequence, logits_row: torch.Tensor, step: int, before: list[int], suppressed: Ids[int] = ()) -> int:
    """The token of one row picked alone (``sample_next_token``'s steps); ``before``: tokens picked
    ahead of it this step."""
    params, scores = seq.params, logits_row.float()
    if params.repetition_penalty != 1.0:
        scores = penalize_repetitions(scores, seq.token_ids + before if before else seq.token_ids,
                                      params.repetition_penalty)
    scores = suppress_tokens(scores, suppressed)
    if params.temperature > 0:
        scores = seeded_rows(scores[None], [(seq, step)])[0]
    return int(scores.argmax())
