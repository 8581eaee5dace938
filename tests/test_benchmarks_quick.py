"""A minimal in-process slice of the benchmark harness (the full ``python -m benchmarks --quick``
runs in CI on its own): one matmul shape, one divergence case, a small scoring section, the report
files and their schema."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ is a folder of the repository, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import divergence, matmul, scoring  # noqa: E402
from benchmarks.report import metadata, validate, write_all  # noqa: E402
from benchmarks.timing import Run  # noqa: E402
from invariant_infer.random_checkpoints import qwen2_config  # noqa: E402


@pytest.fixture(scope="module")
def results():
    ctx = Run(device=torch.device("cpu"), quick=True)
    out = metadata(ctx.device, quick=True)
    out.update({"rmsnorm": [], "attention": [], "decode_attention": [], "e2e": [], "decode": []})
    ctx.section = "matmul"
    out.update(matmul.run(ctx, shapes={"q": (96, 96, True)}, ms=(1, 8)))
    ctx.section = "divergence"
    case = divergence.Case("left-pad B=3 lens 6/3/1", (6, 3, 1))
    out.update(divergence.run(ctx, config=qwen2_config("tiny", num_hidden_layers=1), cases=[case]))
    ctx.section = "scoring"
    # T=96 with the quick chunk of 64 rows: two chunks, one partial. 4 sequences of 6-12 tokens:
    # one batch under a 64-token budget, several under 16.
    out.update(scoring.run(ctx, config=qwen2_config("tiny", num_hidden_layers=1), memory_shape=(32, 512),
                           memory_tokens=(96,), throughput=(4, 6, 12, 64, 16)))
    out["skipped"] = ctx.skipped
    return out


def test_sections_ran(results):
    assert results["skipped"] == []
    assert [(r["shape"], r["M"]) for r in results["matmul"]] == [("q", 1), ("q", 8)]
    assert len(results["divergence"]) == 1


def test_schema_fields(results):
    assert validate(results) == []
    assert results["timings_meaningful"] is False and results["quick"] is True
    for row in results["matmul"]:
        assert row["stock_tflops"] > 0 and row["invariant_tflops"] > 0
        assert row["max_abs_diff"] < 0.1


def test_invariant_rows_bitwise_equal(results):
    row = results["divergence"][0]
    assert row["invariant_rows_checked"] == 3 == row["stock_rows_checked"]
    assert row["invariant_rows_unequal"] == 0
    assert row["invariant_max_abs_diff"] == 0.0
    assert all(r["invariant_row0_equal"] for r in results["matmul"])


def test_scoring_fields(results):
    (mem,) = results["scoring_memory"]
    assert (mem["tokens"], mem["hidden"], mem["vocab"], mem["chunk_rows"]) == (96, 32, 512, 64)
    assert mem["peak_gb_method"] == "estimate"  # CPU: analytic, labelled as such
    assert mem["naive_peak_gb"] == mem["naive_estimate_gb"] == 96 * 512 * 8 / 1e9
    assert 0 < mem["ours_peak_gb"] < mem["naive_peak_gb"] and mem["memory_ratio"] > 1
    assert mem["naive_ms"] > 0 and mem["ours_ms"] > 0 and mem["naive_skipped"] is None is mem["ours_skipped"]
    assert mem["max_abs_diff"] < 1e-3 and mem["is_argmax_agree"] is True and mem["argmax_targets"] == 48
    (thr,) = results["scoring_throughput"]
    assert thr["sequences"] == 4 and thr["tokens"] == thr["scored_tokens"] + 4
    assert thr["batches"] == 1 < thr["alt_batches"]
    assert thr["stock_tokens_per_s"] > 0 and thr["invariant_tokens_per_s"] > 0
    assert thr["stock_peak_gb"] is None and thr["invariant_peak_gb"] is None  # CPU
    assert thr["max_abs_diff"] < 0.05
    assert thr["digests_equal_across_budgets"] is True


def test_report_files(results, tmp_path):
    write_all(dict(results), tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert validate(on_disk) == []
    assert not any(key.startswith("_") for row in on_disk["divergence"] for key in row)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "NOT meaningful" in text and "left-pad B=3" in text
    assert "## Scoring" in text and "analytic estimates, not measurements" in text
    assert not any(key.startswith("_") for key in on_disk["scoring_memory"][0])
    for name in ("overhead_vs_m.png", "divergence.png"):
        assert (tmp_path / name).stat().st_size > 10_000
