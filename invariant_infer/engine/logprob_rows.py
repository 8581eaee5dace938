"""Logprobs of the engine's logits rows: sampled tokens', prompt tokens' and the top alternatives',
all from the runner's one logprob kernel, each row reduced alone (so no grouping changes a bit)."""
from __future__ import annotations

import torch


def row_logprobs(runner, logits: torch.Tensor, targets: list[int], temperatures: list[float]):
    """(logprobs, is-argmax) lists for rows [R, V] at each row's temperature: one launch per
    temperature."""
    values, is_argmax = [0.0] * len(targets), [False] * len(targets)
    for temperature in dict.fromkeys(temperatures):
        rows = [i for i, t in enumerate(temperatures) if t == temperature]
        ids = torch.tensor([targets[i] for i in rows], device=logits.device)
        group = logits if len(rows) == len(targets) else logits[rows]
        got, hit = runner.logprobs(group, ids, temperature)
        for i, value, greedy in zip(rows, got.tolist(), hit.tolist()):
            values[i], is_argmax[i] = value, greedy
    return values, is_argmax


def record_prompt_logprobs(runner, logits, targets, owners) -> None:
    """Append each prompt row's logprob (and top alternatives, if asked) to its sequence."""
    values, is_argmax = row_logprobs(runner, logits, targets, [seq.params.logprob_temperature for seq in owners])
    for i, (seq, value, greedy) in enumerate(zip(owners, values, is_argmax)):
        seq.prompt_logprobs.append(value)
        seq.prompt_greedy.append(greedy)
        if seq.params.prompt_logprobs:
            seq.prompt_top_logprobs.append(top_logprobs(runner, logits[i], seq.params.prompt_logprobs,
                                                        seq.params.logprob_temperature))


def top_logprobs(runner, logits_row: torch.Tensor, k: int, temperature: float) -> dict[int, float]:
    """The k most likely tokens and their logprobs, from the same kernel as a sampled token's."""
    ids = torch.topk(logits_row.float(), k).indices
    values = runner.logprobs(logits_row[None].expand(k, -1), ids, temperature)[0].tolist()
    return dict(zip(ids.tolist(), values))
