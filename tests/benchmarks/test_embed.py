"""The embedding models' section (``python -m benchmarks embed``) apart from the quick run that
test_benchmarks_quick.py checks: its command line, its stock baseline against sentence-transformers' own
``Pooling``, and its alone-vs-batch check against a batch-variant linear (the negative control)."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import embed  # noqa: E402
from benchmarks.__main__ import parse  # noqa: E402
from benchmarks.gpu_check_plan import BENCH_MARGIN_S, SLICES, plan  # noqa: E402
from benchmarks.timing import Run  # noqa: E402
from helpers.controls import m_dependent_linear  # noqa: E402


def test_embed_command_runs_the_section_alone():
    args = parse(["embed", "--quick", "--out", "x"])
    assert args.only == ["embed"] and args.quick and args.out == Path("x")
    assert parse([]).only[-1] == "embed"  # and the full suite runs it too


def test_the_gpu_check_measures_it_in_its_own_slice(tmp_path):
    """On a GPU the check runs the whole section (every item) in ``rest_embed``, its items stopping a margin
    before the slice ends; the dry run leaves it out (the quick run covers it on CPU)."""
    (section,) = [s for s in plan(tmp_path, tmp_path, dry_run=False, gpus=1) if s.name == "rest_embed"]
    argv = section.argv
    assert argv[argv.index("benchmarks.gpu_check_bench") + 1] == "embed" and "--quick" not in argv
    assert argv[argv.index("--items") + 1] == "rest" and section.slice_s == SLICES["rest_embed"]
    assert float(argv[argv.index("--budget-s") + 1]) == SLICES["rest_embed"] - BENCH_MARGIN_S
    assert "rest_embed" not in [s.name for s in plan(tmp_path, tmp_path, dry_run=True, gpus=0)]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["cls", "mean", "lasttoken"])
def test_stock_pool_is_sentence_transformers_pooling(mode, side):
    """The baseline pools as sentence-transformers does, bitwise (bf16 hidden states, padded rows)."""
    from sentence_transformers.sentence_transformer.modules import Pooling
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 9, 32, generator=gen).to(torch.bfloat16)
    rows = [torch.zeros(n, dtype=torch.long) for n in (9, 1, 4, 7, 2)]
    _, mask = embed.pad(rows, side, 0, "cpu")
    want = Pooling(32, mode)({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    assert torch.equal(embed.stock_pool(hidden, mask, mode), want)


@pytest.mark.heavy
def test_divergence_check_catches_an_m_dependent_linear(monkeypatch):
    """Negative control: every linear picks BLOCK_K 16 up to 16 rows (a row alone, at most 16 tokens) and 64
    above (the batch of 8); the invariant path's alone-vs-batch check must then see rows differ. In fp32: at
    the tiny widths (K 64 and 128) the two blockings' fp32 sums round to the same bf16 outputs, which would hide
    the control in bf16."""
    import invariant_infer.model.layer_forwards

    def divergence_row():
        ctx = Run(device=torch.device("cpu"), quick=True)
        ctx.section = "embed"
        speed, (row,) = embed.model_rows(ctx, embed.MODELS[0], batches=(), divergence_batches=(8,),
                                         dtype=torch.float32)
        assert ctx.skipped == [] and speed == [] and row["invariant_rows_checked"] == embed.QUICK_CHECKED_ROWS
        return row["invariant_rows_unequal"], row["invariant_max_abs_diff"]

    assert divergence_row() == (0, 0.0)
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear",
                        functools.partial(m_dependent_linear, small_m=16))
    unequal, diff = divergence_row()
    assert unequal > 0 and diff > 0
