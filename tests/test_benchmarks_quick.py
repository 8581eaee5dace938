"""A minimal in-process slice of the benchmark harness (the full ``python -m benchmarks --quick``
runs in CI on its own): one matmul shape, one divergence case, a small scoring section, the report
files and their schema; ``--model-preset`` (validation, shapes per family, and the cheap sections
in quick mode for a Llama preset); the serving-engine section in quick mode; the HTTP server section
in quick mode (two real ``invariant-infer serve`` subprocesses)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ is a folder of the repository, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import divergence, matmul, scoring  # noqa: E402
from benchmarks import engine as engine_bench  # noqa: E402
from benchmarks import server as server_bench  # noqa: E402
from benchmarks.__main__ import main as bench_main  # noqa: E402
from benchmarks.__main__ import parse  # noqa: E402
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
    assert results["model"]["name"] == "qwen2:qwen2.5-1.5b" and results["model"]["rms_norm"] == "Qwen2RMSNorm"
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


def test_model_preset_default_and_validation(capsys):
    assert parse([]).model_preset == ("qwen2", "qwen2.5-1.5b")
    assert parse(["--model-preset", "qwen3:qwen3-8b"]).model_preset == ("qwen3", "qwen3-8b")
    for value in ("llama", "llama:nope", "gpt2:tiny", ":tiny"):
        with pytest.raises(SystemExit) as exc:
            parse(["--model-preset", value])
        assert exc.value.code == 2
        assert "argument --model-preset" in capsys.readouterr().err


def test_matmul_shapes_follow_the_preset():
    # Qwen2.5-1.5B: the shapes the suite always measured (q/k/v bias).
    assert matmul.model_shapes("qwen2", "qwen2.5-1.5b") == {
        "q": (1536, 1536, True), "k/v": (256, 1536, True), "o": (1536, 1536, False),
        "gate/up": (8960, 1536, False), "down": (1536, 8960, False), "lm_head": (151936, 1536, False)}
    # Llama tiny sets attention_bias and mlp_bias; Qwen3-0.6B's head_dim 128 != 1024 / 16.
    assert all(bias for name, (_, _, bias) in matmul.model_shapes("llama", "tiny").items() if name != "lm_head")
    qwen3 = matmul.model_shapes("qwen3", "qwen3-0.6b")
    assert (qwen3["q"], qwen3["k/v"], qwen3["o"]) == ((2048, 1024, False), (1024, 1024, False), (1024, 2048, False))


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """python -m benchmarks --quick --model-preset llama:llama-3.2-1b, the cheap sections, in-process."""
    out = tmp_path_factory.mktemp("llama")
    rc = bench_main(["--quick", "--model-preset", "llama:llama-3.2-1b", "--only", "matmul,norm_attention",
                     "--out", str(out), "--no-plots"])
    return rc, json.loads((out / "results.json").read_text()), (out / "RESULTS.md").read_text()


def test_quick_run_for_a_llama_preset(llama_run):
    rc, results, text = llama_run
    assert rc == 0 and results["skipped"] == [] and results["quick"] is True
    model = results["model"]
    assert (model["name"], model["family"], model["preset"]) == ("llama:llama-3.2-1b", "llama", "llama-3.2-1b")
    assert (model["hidden_size"], model["head_dim"], model["rms_norm"]) == (2048, 64, "LlamaRMSNorm")
    # Quick: Llama-3.2-1B's projections with N and K divided by 16 (no biases in this preset).
    assert {r["shape"]: (r["N"], r["K"], r["bias"]) for r in results["matmul"] if r["M"] == 1} == {
        "q": (128, 128, False), "k/v": (32, 128, False), "o": (128, 128, False), "gate/up": (512, 128, False),
        "down": (128, 512, False), "lm_head": (8016, 128, False)}
    assert all(r["invariant_row0_equal"] for r in results["matmul"])
    assert {(r["N"], r["stock_class"]) for r in results["rmsnorm"]} == {(2048, "LlamaRMSNorm")}
    assert {(r["heads"], r["kv_heads"], r["head_dim"]) for r in results["attention"]} == {(4, 2, 64)}
    assert "llama:llama-3.2-1b" in text.splitlines()[0] and "HF `LlamaRMSNorm`" in text


def test_divergence_for_a_llama_preset():
    """Quick divergence builds the preset with 1 layer and vocab 2048 (here Llama tiny: both bias flags, llama3
    RoPE scaling); right padding through batch_drift; invariant rows bitwise equal."""
    ctx = Run(device=torch.device("cpu"), quick=True)
    ctx.section = "divergence"
    case = divergence.Case("right-pad B=3 lens 5/2/1", (5, 2, 1), side="right")
    (row,) = divergence.run(ctx, cases=[case], family="llama", preset="tiny")["divergence"]
    assert ctx.skipped == []
    assert (row["preset"], row["layers"], row["vocab"], row["padding"]) == ("llama:tiny", 1, 2048, "right")
    assert row["stock_rows_checked"] == 3 == row["invariant_rows_checked"]
    assert row["invariant_rows_unequal"] == 0 and row["invariant_max_abs_diff"] == 0.0
    assert row["invariant_frac_unequal"] == 0.0


@pytest.fixture(scope="module")
def engine_rows():
    """The engine section as quick mode runs it: qwen2 tiny, concurrency 1 and 4 (2 and 4 requests), 4 tokens."""
    ctx = Run(device=torch.device("cpu"), quick=True)
    ctx.section = "engine"
    out = engine_bench.run(ctx)
    assert ctx.skipped == []
    return out["engine"]


def test_engine_rows_three_modes(engine_rows):
    assert [(r["mode"], r["concurrency"]) for r in engine_rows] == [
        (mode, conc) for conc in engine_bench.QUICK_CONCURRENCY for mode in engine_bench.MODES]
    for row in engine_rows:
        assert row["preset"] == "qwen2:tiny" and row["max_tokens"] == engine_bench.QUICK_MAX_TOKENS
        assert row["requests"] == dict(zip(engine_bench.QUICK_CONCURRENCY, engine_bench.QUICK_REQUESTS))[
            row["concurrency"]]
        assert row["output_tokens"] == row["requests"] * row["max_tokens"] > 0  # ignore_eos / min_new_tokens
        assert row["tokens_per_s"] > 0 and row["tpot_ms"] > 0 and row["ttft_ms"] > 0 and row["elapsed_s"] > 0
        engine_mode = row["mode"] != "hf_generate"
        assert (row["preemptions"] == 0) if engine_mode else (row["preemptions"] is None)
        if row["mode"] == "invariant_engine":
            assert row["invariant_to_stock_engine"] > 0 and row["invariant_to_hf_generate"] > 0
        else:
            assert row["invariant_to_stock_engine"] is None is row["invariant_to_hf_generate"]
            assert row["invariant_rows_checked"] is None is row["invariant_rows_equal"]


def test_engine_invariant_requests_equal_alone(engine_rows):
    checked = [r for r in engine_rows if r["mode"] == "invariant_engine" and r["concurrency"] > 1]
    assert checked
    for row in checked:
        assert row["invariant_rows_checked"] == 2 == row["invariant_rows_equal"]


def test_engine_report(engine_rows, tmp_path):
    results = metadata(torch.device("cpu"), quick=True)
    results.update({"matmul": [], "e2e": [], "divergence": [], "engine": engine_rows})
    assert validate(results) == []
    write_all(results, tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert validate(on_disk) == [] and len(on_disk["engine"]) == len(engine_rows)
    assert not any(key.startswith("_") for row in on_disk["engine"] for key in row)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## Serving engine (qwen2:tiny" in text and "÷ stock engine" in text and "| 2/2 |" in text
    assert on_disk["plots"] == ["engine.png"] and (tmp_path / "engine.png").stat().st_size > 10_000


def test_server_section_quick():
    """Quick server section (qwen2 tiny with 1 layer, for CI time): both modes at concurrency 1 and 4, every
    request 200 with max_tokens tokens, the invariant server's checked responses equal the same requests
    alone; both servers exit 0 on SIGTERM."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("requests")
    ctx = Run(device=torch.device("cpu"), quick=True)
    ctx.section = "server"
    rows = server_bench.run(ctx, config=qwen2_config("tiny", num_hidden_layers=1))["server"]
    assert ctx.skipped == []
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        (mode, conc) for conc in server_bench.QUICK_CONCURRENCY for mode in server_bench.MODES]
    for row in rows:
        assert (row["preset"], row["layers"]) == ("qwen2:custom", 1)
        assert row["errors"] == 0 and row["server_exit_code"] == 0 and row["requests"] == 4
        assert row["output_tokens"] == row["requests"] * server_bench.QUICK_MAX_TOKENS > 0
        assert row["tokens_per_s"] > 0 and row["requests_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        if row["mode"] == "invariant":
            assert row["invariant_to_stock"] > 0
        else:
            assert row["invariant_to_stock"] is None is row["invariant_rows_checked"]
    checked = [r for r in rows if r["mode"] == "invariant" and r["concurrency"] > 1]
    assert checked and all(r["invariant_rows_checked"] == 2 == r["invariant_rows_equal"] for r in checked)
    results = metadata(torch.device("cpu"), quick=True)
    results.update({"matmul": [], "e2e": [], "divergence": [], "server": rows})
    assert validate(results) == []
