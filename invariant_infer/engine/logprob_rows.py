"""Logprobs of the engine's logits rows: sampled tokens', prompt tokens' and the top alternatives',
all from the runner's one logprob kernel, each row reduced alone (so no grouping changes a bit)."""
from __future__ import annotations

import torch


def row_logprobs(runner, logits: torch.Tensor, targets: list[int], temperatures: list[float]):
    """(logprobs, is-argmax) lists for rows [R, V] at each row's temperature: one launch per
    temperature, and one device-to-host copy for all rows."""
    groups = {temperature: [i for i, t in enumerate(temperatures) if t == temperature]
              for temperature in dict.fromkeys(temperatures)}
    ids = torch.tensor(targets, device=logits.device)
    order, values, hits = [], [], []
    for temperature, rows in groups.items():
        whole = len(rows) == len(targets)
        got, hit = runner.logprobs(logits if whole else logits[rows], ids if whole else ids[rows], temperature)
        order += rows
        values.append(got.float())
        hits.append(hit.float())
    if not order:
        return [], []
    host = torch.cat([*values, *hits]).tolist()  # the one device-to-host copy
    out_values, is_argmax = [0.0] * len(targets), [False] * len(targets)
    for i, value, greedy in zip(order, host[:len(order)], host[len(order):]):
        out_values[i], is_argmax[i] = value, bool(greedy)
    return out_values, is_argmax


def record_prompt_logprobs(runner, logits, targets, owners) -> None:
    """Append each prompt row's logprob (and top alternatives, if asked) to its sequence."""
    values, is_argmax = row_logprobs(runner, logits, targets, [seq.params.logprob_temperature for seq in owners])
    for seq, value, greedy in zip(owners, values, is_argmax):
        seq.prompt_logprobs.append(value)
        seq.prompt_greedy.append(greedy)
    wanted = [(i, seq) for i, seq in enumerate(owners) if seq.params.prompt_logprobs]
    for (_, seq), top in zip(wanted, top_logprobs_rows(runner, logits, [(i, seq.params.prompt_logprobs,
                                                                           seq.params.logprob_temperature)
                                                                          for i, seq in wanted])):
        seq.prompt_top_logprobs.append(top)


def record_top_logprobs(runner, logits, rows) -> None:
    """Append the top alternatives of each sampled row ``(row, seq)`` to its sequence, in order."""
    tops = top_logprobs_rows(runner, logits, [(row, seq.params.logprobs, seq.params.logprob_temperature)
                                              for row, seq in rows])
    for (_, seq), top in zip(rows, tops):
        seq.top_logprobs.append(top)


def top_logprobs_rows(runner, logits: torch.Tensor, rows: list[tuple[int, int, float]]) -> list[dict[int, float]]:
    """For rows ``(row, k, temperature)``: the k most likely tokens and their logprobs, from the same
    kernel as a sampled token's. Rows of one (k, temperature) go in one topk and one launch; each
    row's values are its own (the kernel reduces each row alone). One device-to-host copy in all."""
    groups: dict[tuple[int, float], list[int]] = {}
    for i, (_, k, temperature) in enumerate(rows):
        groups.setdefault((k, temperature), []).append(i)
    pieces = []
    for (k, temperature), members in groups.items():
        group = logits[[rows[i][0] for i in members]]
        ids = torch.topk(group.float(), k).indices                        # [R, k]
        values = runner.logprobs(group.repeat_interleave(k, dim=0), ids.flatten(), temperature)[0]
        pieces += [ids.flatten().double(), values.double()]  # token ids below 2 ** 53: exact in float64
    host = torch.cat(pieces).tolist() if pieces else []  # the one device-to-host copy
    tops: list[dict[int, float] | None] = [None] * len(rows)
    at = 0
    for (k, _), members in groups.items():
        count = len(members) * k
        ids, values = host[at:at + count], host[at + count:at + 2 * count]
        at += 2 * count
        for j, i in enumerate(members):
            tops[i] = dict(zip((int(t) for t in ids[j * k:(j + 1) * k]), values[j * k:(j + 1) * k]))
    return tops
