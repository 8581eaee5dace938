"""The phenomenon: a row's logits computed in a batch vs the same row alone, stock and invariant.

For each case a batch of rows (left or right padded to one length) is scored once; then each
checked row is scored alone, unpadded, batch size 1: the project's one batch-vs-alone measurement,
``invariant_infer.testing.drift.batch_drift``. Compared on the row's real tokens: max |delta logit| and the
number of rows whose logits are not bitwise equal (torch.equal). The batch gets position_ids =
cumsum(mask) - 1 (as generate() does), so padding never shifts positions and any difference comes
from reduction order alone. Model: the preset (default Qwen2.5-1.5B); quick: its real widths with
1 layer and a 2048-token vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from invariant_infer import make_invariant, restore
from invariant_infer.testing.drift import batch_drift

from .e2e import build_model, preset_config
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, free_memory


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple  # real tokens per row
    side: str = "left"  # padding side
    invariant_rows: int | None = None  # check only this many rows alone for invariant (None = all)


def _random_lengths(seed: int, n: int, hi: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (hi,) + tuple(torch.randint(1, hi + 1, (n - 1,), generator=g).tolist())


CASES = (
    Case("left-pad B=4 lens 33/20/9/1", (33, 20, 9, 1)),
    Case("left-pad B=8 lens 1..256", _random_lengths(1, 8, 256)),
    Case("right-pad B=8 lens 1..256", _random_lengths(2, 8, 256), side="right"),
    Case("no pad B=8 L=128", (128,) * 8),
    Case("decode-shaped B=16 L=1", (1,) * 16),
    Case("decode-shaped B=64 L=1", (1,) * 64),
    Case("left-pad B=32 lens 1..512", _random_lengths(3, 32, 512)),
)
# Quick mode: stock HF at the preset's real widths (1 layer, vocab 2048) is cheap on CPU; the
# invariant path runs there through the interpreter (about 2-8 s a forward at Qwen2.5-1.5B's
# widths), so it checks the first and last rows of each case alone: decode-shaped rows, and
# left-padded rows across an attention block boundary.
QUICK_CASES = (
    Case("decode-shaped B=16 L=1", (1,) * 16, invariant_rows=2),
    Case("left-pad B=4 lens 33/20/9/1", (33, 20, 9, 1), invariant_rows=2),
)


QUICK_OVERRIDES = dict(num_hidden_layers=1, vocab_size=2048)


def _samples(case: Case, vocab: int, gen: torch.Generator) -> list:
    """One row of random token ids per length (unpadded; batch_drift pads them)."""
    return [torch.randint(0, vocab, (n,), generator=gen) for n in case.lengths]


def _checked_rows(n_rows: int, limit: int | None) -> list:
    """All rows, or ``limit`` rows spread evenly over the batch (first and last included)."""
    if limit is None or limit >= n_rows:
        return list(range(n_rows))
    if limit <= 1:
        return [0][:limit]
    return sorted({round(i * (n_rows - 1) / (limit - 1)) for i in range(limit)})


def run(ctx: Run, config=None, cases=None, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY,
        preset: str = DEFAULT_PRESET) -> dict:
    config, name = preset_config(family, preset, config, **(QUICK_OVERRIDES if ctx.quick else {}))
    cases = cases or (QUICK_CASES if ctx.quick else CASES)
    model = build_model(ctx, config, dtype)
    gen = torch.Generator().manual_seed(4)
    samples_per_case = [_samples(case, config.vocab_size, gen) for case in cases]
    results = {case.name: {"case": case.name, "batch": len(case.lengths), "lengths": list(case.lengths),
                           "padding": case.side, "preset": name, "layers": config.num_hidden_layers,
                           "hidden": config.hidden_size, "intermediate": config.intermediate_size,
                           "vocab": config.vocab_size, "dtype": str(dtype)[6:]} for case in cases}
    with torch.inference_mode():
        for mode in ("stock", "invariant"):
            if mode == "invariant":
                make_invariant(model)
            try:
                for case, samples in tqdm(list(zip(cases, samples_per_case)), desc=f"divergence {mode}", leave=False):
                    limit = case.invariant_rows if mode == "invariant" else None
                    rows = _checked_rows(len(case.lengths), limit)
                    if not rows or ctx.out_of_time(f"divergence {mode} {case.name}"):
                        continue
                    try:
                        drift = batch_drift(model, samples, side=case.side, checked=rows)
                    except Exception as exc:
                        ctx.failed(f"divergence {mode} {case.name}", exc)
                        continue
                    results[case.name].update({f"{mode}_max_abs_diff": drift.max_abs_diff,
                                               f"{mode}_rows_unequal": drift.rows_unequal,
                                               f"{mode}_rows_checked": drift.rows})
            finally:
                restore(model)
    del model
    free_memory(ctx.device)
    out = []
    for row in results.values():
        for mode in ("stock", "invariant"):
            for key in ("max_abs_diff", "rows_unequal", "rows_checked"):
                row.setdefault(f"{mode}_{key}", None)
            checked = row[f"{mode}_rows_checked"]
            row[f"{mode}_frac_unequal"] = row[f"{mode}_rows_unequal"] / checked if checked else None
        out.append(row)
    return {"divergence": out}
