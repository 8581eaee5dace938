"""Row-local sampling: counter-based noise, exact top-k/top-p filters, seeded Gumbel-max.

Shared by ``generate`` (through ``SeededSampling``) and the serving engine, so that the same
seed gives the same tokens in both. ``seeded_scores`` and ``sample_next_token`` define a row's
sample on that row alone; ``seeded_scores_rows`` computes it for many rows in a fixed number of
launches, bitwise what each row gets alone, so neither the batch size nor the other rows can
change a bit of it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _MIX1  # int64 products wrap mod 2**64 on CPU and CUDA
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _splitmix64_int(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_noise(seed: int, step: int, size: int, device) -> torch.Tensor:
    """float64 [size] in (0, 1), a pure function of (seed, step, index): counter-based, no generator
    state, identical on CPU and CUDA, and independent of how many other rows there are."""
    key = _signed64(_splitmix64_int(_splitmix64_int(seed) ^ step))
    counter = torch.arange(size, device=device, dtype=torch.int64) * _GOLDEN + key
    bits = _shift_right(_splitmix64(counter), 11)  # top 53 bits
    return (bits.to(torch.float64) + 0.5) * 2.0 ** -53


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """One row [V]: -inf outside the top-k, then outside the smallest set whose probability reaches
    top_p. Exact and row-local: a stable sort of this row alone, ties at the k-th value kept."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def seeded_scores(scores: torch.Tensor, seed: int, step: int, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """One row [V] of scores -> filtered logits plus Gumbel noise for (seed, step), in scores' dtype.
    Its argmax is an exact draw from the temperature/top-k/top-p softmax."""
    logits = filter_logits(scores.float() / temperature, top_k, top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(seed, step, logits.shape[-1], logits.device)))
    return (logits.double() + gumbel).to(scores.dtype)


def seeded_scores_rows(scores: torch.Tensor, seeds: Sequence[int], steps: Sequence[int],
                       temperatures: Sequence[float], top_ks: Sequence[int], top_ps: Sequence[float]) -> torch.Tensor:
    """``seeded_scores`` of every row of ``scores`` [R, V] at once: row r with (seeds[r], steps[r],
    temperatures[r], top_ks[r], top_ps[r]), bitwise what ``seeded_scores`` gives it alone (the same
    ops, each over a row's own values: a row's scores never depend on the other rows or on R).
    A fixed number of launches and two small host-to-device copies, whatever R."""
    rows, vocab = scores.shape
    device = scores.device
    keys = [_signed64(_splitmix64_int(_splitmix64_int(seed) ^ step)) for seed, step in zip(seeds, steps)]
    ints = torch.tensor([keys, list(top_ks)], dtype=torch.int64).to(device)
    floats = torch.tensor([list(temperatures), list(top_ps)], dtype=torch.float32).to(device)
    logits = _divide(scores.float(), floats[0, :, None])
    if any(0 < k < vocab for k in top_ks):  # -inf outside each row's top k (ties at the k-th value kept)
        active = (ints[1] > 0) & (ints[1] < vocab)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (ints[1] - 1).clamp(0, vocab - 1)[:, None])
        logits = logits.masked_fill(logits < torch.where(active[:, None], kth, float("-inf")), float("-inf"))
    if any(p < 1.0 for p in top_ps):  # -inf outside the smallest set whose probability reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= floats[1, :, None]
        drop_sorted[:, 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted) & (floats[1] < 1.0)[:, None]
        logits = logits.masked_fill(drop, float("-inf"))
    counter = torch.arange(vocab, device=device, dtype=torch.int64)[None, :] * _GOLDEN + ints[0, :, None]
    noise = (_shift_right(_splitmix64(counter), 11).to(torch.float64) + 0.5) * 2.0 ** -53  # uniform_noise's
    gumbel = -torch.log(-torch.log(noise))
    return (logits.double() + gumbel).to(scores.dtype)


def _divide(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits [R, V] / temperatures [R, 1] as a tensor divided by a Python float rounds: a true division
    on CPU; on CUDA a product with the reciprocal (what CUDA's division by a host scalar computes)."""
    return logits * temperatures.reciprocal() if logits.is_cuda else logits / temperatures


def suppress_tokens(scores: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """scores [..., V] with the logits of ``token_ids`` set to -inf (a copy), so neither greedy nor seeded
    picking ever takes them (transformers' ``suppress_tokens``); each row alone."""
    if not token_ids:
        return scores
    ids = torch.tensor(list(token_ids), dtype=torch.long).to(scores.device)
    return scores.index_fill(-1, ids, float("-inf"))


def penalize_repetitions(scores: torch.Tensor, tokens: Sequence[int] | torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty on one row [V]: scores of tokens already in the sequence are
    divided by ``penalty`` when positive and multiplied by it when negative."""
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=scores.device)
    seen = scores.gather(0, tokens)
    return scores.scatter(0, tokens, torch.where(seen < 0, seen * penalty, seen / penalty))


def sample_next_token(scores: torch.Tensor, tokens: Sequence[int], *, step: int, seed: int,
                      temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      repetition_penalty: float = 1.0) -> int:
    """The next token for one sequence from its fp32 scores [V], as ``generate`` picks it: repetition
    penalty over ``tokens`` (the sequence so far), then greedy (temperature 0) or seeded sampling
    with noise for (seed, step), step counting generated tokens from 0."""
    if repetition_penalty != 1.0:
        scores = penalize_repetitions(scores, tokens, repetition_penalty)
    if temperature > 0:
        scores = seeded_scores(scores, seed, step, temperature, top_k, top_p)
    return int(scores.argmax())
