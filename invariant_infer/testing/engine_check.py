"""The check of ``invariant_infer.testing.invariance_check`` run through an engine: what ``serve``
checks before it takes traffic at ``--tensor-parallel-size`` above 1, where rank 0's model runs only
through its ranks (the engine's executor), so each forward must be a step every rank runs.

On the probe rows of random token ids (lengths ``ENGINE_PROBE_LENGTHS``, two or more tokens: a row
scores its tokens after the first):
  * the audit of one forward on every rank (a worker command; rank 0's report is the one shown, the
    other ranks run the same code on their shards);
  * each row's prompt logprobs alone (its own steps) against the rows' in one engine batch (padding
    is moot in the engine: rows are packed);
  * greedy decoding of the longest row, each generated token's logprobs against the same position
    of the prefill of the prompt and the generated tokens.
Each position compares its token's logprob and its top ``MAX_LOGPROBS`` alternatives (ids, and the
values with ``torch.equal``): the engine's bitwise-comparable view of a logits row. The probes run
on the base model and leave no request behind."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import RequestFailedError
from ..engine.sampling_params import MAX_LOGPROBS, SamplingParams
from ..model.audit import audit
from ..model.executor import RankState, worker_command
from .invariance_check import CheckReport, CheckResult, probe_rows, run_checks

ENGINE_PROBE_LENGTHS = (5, 2, 9, 3)
DECODE_TOKENS = 3


def check_engine_invariance(engine, *, seed: int = 0, lengths: Sequence[int] = ENGINE_PROBE_LENGTHS,
                            decode_tokens: int = DECODE_TOKENS,
                            on_result: Callable[[CheckResult], None] | None = None) -> CheckReport:
    """Run the audit and the probes through ``engine`` (and its executor's ranks), each result passed
    to ``on_result`` as it comes."""
    samples = [row.tolist() for row in probe_rows(engine.model, lengths, seed)]
    shown = ", ".join(map(str, lengths))
    longest = max(samples, key=len)
    checks = [("audit", "audit: every reduction of a forward runs on an invariant kernel (on every rank)",
               lambda: _audit_on_ranks(engine)),
              ("batch", f"rows of {shown} tokens alone == in one engine batch",
               lambda: _alone_and_together(engine, samples)),
              ("decode", f"{decode_tokens} greedy decode steps == the same positions of the prefill "
                         f"({len(longest)} + {decode_tokens} tokens)",
               lambda: _decode(engine, longest, decode_tokens))]
    return run_checks(checks, on_result)


@worker_command
def _audit_on_rank(rank: RankState, payload) -> None:
    audit(rank.model)  # the same forward as rank 0's, in step; rank 0 reports


def _audit_on_ranks(engine) -> tuple:
    executor = engine.core.runner.executor
    found = executor.collective_rpc(_audit_on_rank, None, lambda: audit(executor.model))
    return found.ok, None, [f"stray op {op} in {module or '<model>'}" for module, op in found.stray]


def _positions(logprobs: list[float], top: list[dict[int, float]]) -> tuple[list, torch.Tensor]:
    """(the top tokens' ids, [positions, 1 + top] logprobs: the token's own, then its top alternatives)."""
    return [list(t) for t in top], torch.tensor([[own, *t.values()] for own, t in zip(logprobs, top)],
                                                dtype=torch.float32).reshape(len(logprobs), -1)


def _compare(expected: list[tuple], got: list[tuple], label: Callable[[int], str]) -> tuple:
    mismatches = []
    for i, ((ids_a, a), (ids_b, b)) in enumerate(zip(expected, got)):
        if ids_a != ids_b:
            mismatches.append((i, None))
        elif not torch.equal(a, b):
            mismatches.append((i, (a - b).abs().max().item()))
    if not mismatches:
        return True, None, []
    diffs = [diff for _, diff in mismatches if diff is not None]
    return (False, max(diffs) if diffs else None,
            [f"{label(i)}: " + (f"max |Δ logprob| {diff:.6g}" if diff is not None else "other top tokens")
             for i, diff in mismatches])


def _prefilled(engine, rows: list[list[int]], start: int = 1) -> list[tuple]:
    """Each row's logprobs (and top alternatives) of its tokens from ``start`` on, from a prefill."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=MAX_LOGPROBS)
    outs = engine.generate(rows, params)
    for out in outs:
        if out.error:
            raise RequestFailedError(out.error)
    return [_positions(out.prompt_logprobs[start - 1:], out.prompt_top_logprobs[start - 1:]) for out in outs]


def _alone_and_together(engine, samples: list[list[int]]) -> tuple:
    alone = [_prefilled(engine, [sample])[0] for sample in samples]
    return _compare(alone, _prefilled(engine, samples), lambda i: f"row {i} (length {len(samples[i])})")


def _decode(engine, prompt: list[int], tokens: int) -> tuple:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=MAX_LOGPROBS)
    out = engine.generate([prompt], params)[0]
    if out.error:
        raise RequestFailedError(out.error)
    ids, decoded = _positions(out.logprobs, out.top_logprobs)
    prefill_ids, prefilled = _prefilled(engine, [prompt + list(out.token_ids)], start=len(prompt))[0]
    return _compare([(prefill_ids[i:i + 1], prefilled[i:i + 1]) for i in range(len(ids))],
                    [(ids[i:i + 1], decoded[i:i + 1]) for i in range(len(ids))],
                    lambda i: f"generated token {i + 1}")
