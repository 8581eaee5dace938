"""The benchmark harness end to end: ``python -m benchmarks --quick`` runs once, as a subprocess, exactly as
a user runs it (every section, the report files, the plots), and the tests check what it wrote: the schema,
each section's rows against the quick settings, bitwise-equal invariant rows, and the report. Apart from that
run: ``--model-preset`` (argument validation, shapes per family, the cheap sections and divergence with right
padding for a Llama preset, in-process)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ is a folder of the repository, not part of the installed package.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import (SECTIONS, attention_vs_stock, divergence, e2e, embed, gdn, host_overhead, matmul,  # noqa: E402
                        moe, norm_attention, quant, scoring, train, vlm)
from benchmarks import tensor_parallel as tp_bench  # noqa: E402
from benchmarks import engine as engine_bench  # noqa: E402
from benchmarks import server as server_bench  # noqa: E402
from benchmarks.__main__ import main as bench_main  # noqa: E402
from benchmarks.__main__ import parse  # noqa: E402
from benchmarks.schema import validate  # noqa: E402
from benchmarks.timing import Run  # noqa: E402
from helpers.controls import m_dependent_grouped_linear, m_dependent_linear  # noqa: E402
from invariant_infer.model import experts as hf_experts  # noqa: E402
from invariant_infer.engine.step_timer import DEVICE_PHASES, HOST_PHASES  # noqa: E402

pytestmark = [pytest.mark.heavy, pytest.mark.file_minutes(3.3)]  # measured on 2 cores: start it early

QUICK_RUN_TIMEOUT_S = 1200
PLOTS = ("overhead_vs_m.png", "throughput_vs_batch.png", "divergence.png", "kernels.png", "engine.png", "server.png",
         "train.png", "moe.png")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """(exit status, results.json, RESULTS.md, output folder, stdout) of one ``python -m benchmarks --quick``."""
    out = tmp_path_factory.mktemp("quick")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=QUICK_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), (out / "RESULTS.md").read_text(), out, proc.stdout


@pytest.fixture(scope="module")
def results(quick_run):
    return quick_run[0]


def test_run_is_complete_and_matches_the_schema(quick_run):
    results, _, _, stdout = quick_run
    assert validate(results) == [] and results["skipped"] == []
    assert results["sections"] == list(SECTIONS) and results["quick"] is True
    assert results["timings_meaningful"] is False and results["device_type"] == "cpu"
    assert results["model"]["name"] == "qwen2:qwen2.5-1.5b" and results["model"]["rms_norm"] == "Qwen2RMSNorm"
    assert not any(key.startswith("_") for rows in results.values() if isinstance(rows, list)
                   for row in rows if isinstance(row, dict) for key in row)
    assert "host overhead invariant running=64" in stdout and "timings NOT meaningful" in stdout  # the summary


def test_matmul_rows(results):
    shapes = {name: (max(16, n // 16), max(16, k // 16), bias)
              for name, (n, k, bias) in matmul.model_shapes("qwen2", "qwen2.5-1.5b").items()}
    rows = results["matmul"]
    assert sorted((r["shape"], r["M"]) for r in rows) == sorted((s, m) for s in shapes for m in matmul.QUICK_MS)
    for row in rows:
        assert (row["N"], row["K"], row["bias"]) == shapes[row["shape"]]
        assert row["stock_tflops"] > 0 and row["invariant_tflops"] > 0 and row["max_abs_diff"] < 0.1
        assert row["invariant_row0_equal"] is True


def test_norm_attention_rows(results):
    assert [r["M"] for r in results["rmsnorm"]] == list(norm_attention.QUICK_NORM_MS)
    assert all(r["N"] == 1536 and r["stock_class"] == "Qwen2RMSNorm" for r in results["rmsnorm"])
    plain = {key: [r for r in results[key] if not r["window"] and not r["sinks"]]
             for key in ("attention", "decode_attention")}
    assert [(r["batch"], r["q_len"]) for r in plain["attention"]] == norm_attention.QUICK_PREFILL_GRID
    assert [(r["batch"], r["kv_len"]) for r in plain["decode_attention"]] == norm_attention.QUICK_DECODE_GRID
    windowed = [(r["batch"], r["kv_len"], r["window"]) for key in ("attention", "decode_attention")
                for r in results[key] if r["window"] and not r["sinks"]]
    assert windowed == norm_attention.QUICK_WINDOW_PREFILL + norm_attention.QUICK_WINDOW_DECODE
    with_sinks = [(r["batch"], r["q_len"], r["kv_len"], r["window"]) for key in ("attention", "decode_attention")
                  for r in results[key] if r["sinks"]]
    assert with_sinks == norm_attention.QUICK_SINK_CASES
    for row in results["attention"] + results["decode_attention"]:
        assert (row["heads"], row["kv_heads"], row["head_dim"]) == (4, 2, 64) and row["max_abs_diff"] < 0.05


def test_attention_vs_stock_rows(results):
    """Every quick item against every stock kernel: measured (close to the invariant output) or skipped
    with the reason; the paged kernel bitwise the attention kernel past three KV blocks."""
    rows = results["attention_vs_stock"]
    items = [("prefill", b, t) for b, t in attention_vs_stock.QUICK_PREFILL]
    items += [("decode", b, c) for b, c in attention_vs_stock.QUICK_DECODE]
    kernels = {"prefill": [("attention", s) for s in ("sdpa_flash", "flash_attn_func")],
               "decode": [(k, s) for k in ("attention", "paged_attention")
                          for s in ("flashinfer_decode", "flash_attn_with_kvcache", "sdpa")]}
    assert [(r["case"], r["batch"], r["kv_len"], r["invariant"], r["stock"].split(" (")[0]) for r in rows] == [
        (case, b, t, kernel, stock) for case, b, t in items for kernel, stock in kernels[case]]
    for row in rows:
        assert (row["heads"], row["kv_heads"], row["head_dim"], row["device"]) == (4, 2, 64, "cpu")
        assert row["skipped"] is None or row["skipped"].startswith(row["stock"].split("_")[0])
        assert row["skipped"] is not None or (row["ratio"] > 0 and row["max_abs_diff"] < 0.05)
        assert row["bitwise_equal_to_attention"] is (True if row["invariant"] == "paged_attention" else None)
    assert any(r["stock"] == "sdpa" and r["skipped"] is None for r in rows)  # the fallback always runs


def test_e2e_rows(results):
    assert [(r["batch"], r["seq"]) for r in results["e2e"]] == list(e2e.QUICK_SCORE_SHAPES)
    assert [r["batch"] for r in results["decode"]] == [b for b, _, _ in e2e.QUICK_DECODE_SHAPES]
    for row in results["e2e"]:
        assert row["stock_tokens_per_s"] > 0 and row["invariant_tokens_per_s"] > 0
        assert row["stock_peak_gb"] is None is row["invariant_peak_gb"]  # CPU


def test_divergence_invariant_rows_bitwise_equal(results):
    rows = {r["case"]: r for r in results["divergence"]}
    assert list(rows) == [case.name for case in divergence.QUICK_CASES]
    for case in divergence.QUICK_CASES:
        row = rows[case.name]
        assert (row["hidden"], row["layers"], row["vocab"]) == (1536, 1, 2048)
        assert row["stock_rows_checked"] == len(case.lengths)
        assert row["invariant_rows_checked"] == min(len(case.lengths), case.invariant_rows or len(case.lengths))
        assert row["invariant_rows_unequal"] == 0 and row["invariant_max_abs_diff"] == 0.0


def test_scoring_rows(results):
    memory = results["scoring_memory"]
    assert [r["tokens"] for r in memory] == list(scoring.QUICK_MEMORY_TOKENS)
    for mem in memory:
        tokens = mem["tokens"]
        assert (mem["hidden"], mem["vocab"], mem["chunk_rows"]) == (64, scoring.QUICK_MEMORY_VOCAB,
                                                                     scoring.QUICK_CHUNK_ROWS)
        assert mem["peak_gb_method"] == "estimate"  # CPU: analytic, labelled as such
        assert mem["naive_peak_gb"] == mem["naive_estimate_gb"] == tokens * scoring.QUICK_MEMORY_VOCAB * 8 / 1e9
        assert 0 < mem["ours_peak_gb"] < mem["naive_peak_gb"] and mem["memory_ratio"] > 1
        assert mem["naive_ms"] > 0 and mem["ours_ms"] > 0 and mem["naive_skipped"] is None is mem["ours_skipped"]
        assert mem["max_abs_diff"] < 1e-3 and mem["is_argmax_agree"] is True and mem["argmax_targets"] == tokens // 2
    (thr,) = results["scoring_throughput"]
    n_seq, _, _, budget, alt = scoring.QUICK_THROUGHPUT
    assert (thr["sequences"], thr["max_batch_tokens"], thr["alt_max_batch_tokens"]) == (n_seq, budget, alt)
    assert thr["tokens"] == thr["scored_tokens"] + n_seq and thr["batches"] < thr["alt_batches"]
    assert thr["stock_tokens_per_s"] > 0 and thr["invariant_tokens_per_s"] > 0 and thr["max_abs_diff"] < 0.05
    assert thr["stock_peak_gb"] is None and thr["invariant_peak_gb"] is None  # CPU
    assert thr["digests_equal_across_budgets"] is True


def test_engine_rows(results):
    rows = results["engine"]
    cpu_modes = [mode for mode in engine_bench.MODES if mode != "invariant_engine_eager"]  # no graphs on CPU
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        (mode, conc) for conc in engine_bench.QUICK_CONCURRENCY for mode in cpu_modes]
    requests = dict(zip(engine_bench.QUICK_CONCURRENCY, engine_bench.QUICK_REQUESTS))
    for row in rows:
        assert row["preset"] == "qwen2:tiny" and row["max_tokens"] == engine_bench.QUICK_MAX_TOKENS
        assert row["requests"] == requests[row["concurrency"]]
        assert row["output_tokens"] == row["requests"] * row["max_tokens"] > 0  # ignore_eos / min_new_tokens
        assert row["tokens_per_s"] > 0 and row["tpot_ms"] > 0 and row["ttft_ms"] > 0 and row["elapsed_s"] > 0
        engine_mode = row["mode"] != "hf_generate"
        assert (row["preemptions"] == 0) if engine_mode else (row["preemptions"] is None)
        if row["mode"] == "invariant_engine":
            assert row["invariant_to_stock_engine"] > 0 and row["invariant_to_hf_generate"] > 0
            assert row["graphs_to_eager"] is None  # the eager mode runs on a GPU only
        else:
            assert row["invariant_to_stock_engine"] is None is row["invariant_to_hf_generate"]
            assert row["invariant_rows_checked"] is None is row["invariant_rows_equal"]
    checked = [r for r in rows if r["mode"] == "invariant_engine" and r["concurrency"] > 1]
    assert checked and all(r["invariant_rows_checked"] == 2 == r["invariant_rows_equal"] for r in checked)


def test_host_overhead_rows(results):
    rows = results["host_overhead"]
    assert [(r["kernels"], r["forward"], r["running"], r["context"]) for r in rows] == [
        ("stock", "stand-in", n, c) for n in host_overhead.QUICK_STAND_IN_RUNNING for c in host_overhead.CONTEXTS] + [
        (k, "model", n, c) for k in host_overhead.KERNELS for n in host_overhead.QUICK_RUNNING[k]
        for c in host_overhead.QUICK_CONTEXTS[k]]
    for row in rows:
        assert (row["preset"], row["layers"], row["steps"]) == ("qwen2:tiny", 1, host_overhead.QUICK_STEPS)
        assert row["host_meaningful"] is True and row["device_meaningful"] is False
        assert all(row[f"{phase}_us"] > 0 for phase in HOST_PHASES + DEVICE_PHASES)
        assert row["host_us"] == pytest.approx(sum(row[f"{p}_us"] for p in HOST_PHASES))  # a sum, not a bit
        assert row["host_us_per_seq"] == pytest.approx(row["host_us"] / row["running"])
        assert all(row[f"{p}_us_per_seq"] == pytest.approx(row[f"{p}_us"] / row["running"]) for p in HOST_PHASES)


def test_server_rows(results):
    rows = results["server"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        (mode, conc) for conc in server_bench.QUICK_CONCURRENCY for mode in server_bench.MODES]
    for row in rows:
        assert (row["preset"], row["dtype"]) == ("qwen2:tiny", "float32")
        assert row["errors"] == 0 and row["server_exit_code"] == 0
        assert row["requests"] == dict(zip(server_bench.QUICK_CONCURRENCY, server_bench.QUICK_REQUESTS))[
            row["concurrency"]]
        assert row["output_tokens"] == row["requests"] * server_bench.QUICK_MAX_TOKENS > 0
        assert row["tokens_per_s"] > 0 and row["requests_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        if row["mode"] == "invariant":
            assert row["invariant_to_stock"] > 0
        else:
            assert row["invariant_to_stock"] is None is row["invariant_rows_checked"]
    checked = [r for r in rows if r["mode"] == "invariant" and r["concurrency"] > 1]
    assert checked and all(r["invariant_rows_checked"] == 2 == r["invariant_rows_equal"] for r in checked)


def test_train_rows(results):
    rows = results["train"]
    assert [(r["layout"], r["batch"], r["seq"]) for r in rows] == [
        (layout, b, s) for layout in train.LAYOUTS for b, s in train.QUICK_SHAPES]
    for row in rows:
        assert (row["preset"], row["layers"], row["dtype"]) == ("qwen2:tiny", 2, "bfloat16")
        assert row["tokens"] >= row["seq"] and row["ratio"] > 0
        assert row["stock_tokens_per_s"] > 0 and row["invariant_tokens_per_s"] > 0
        assert row["stock_peak_gb"] is None is row["invariant_peak_gb"]  # CPU
        assert row["invariant_logprob_max_abs_diff"] == 0.0 and row["invariant_logprob_bitwise_equal"] is True
        assert isinstance(row["stock_logprob_max_abs_diff"], float) and row["stock_logprob_max_abs_diff"] >= 0
        assert isinstance(row["stock_logprob_bitwise_equal"], bool)


def test_train_mismatch_catches_an_m_dependent_linear(monkeypatch):
    """The section's mismatch is 0 on the invariant kernels and nonzero when every projection picks BLOCK_K by M
    (``benchmarks.fuzz``'s negative control: sample 0 alone is 32 rows, BLOCK_K 16; the batch of 3 has more rows,
    the shape's own config), in the forward with grad (the batch) and without (alone)."""
    import invariant_infer.model.layer_forwards
    from benchmarks.fuzz import m_dependent_linear
    # The module, not the package's function of the same name (``import ... as`` would give the function).
    linear_autograd_mod = importlib.import_module("invariant_infer.kernels.linear_autograd")

    def mismatch():
        ctx = Run(device=torch.device("cpu"), quick=True)
        ctx.section = "train"
        rows = train.run(ctx, shapes=((3, 32),), dtype=torch.float32)["train"]
        assert ctx.skipped == [] and [r["layout"] for r in rows] == list(train.LAYOUTS)
        return [(r["invariant_logprob_max_abs_diff"], r["invariant_logprob_bitwise_equal"]) for r in rows]

    assert mismatch() == [(0.0, True)] * len(train.LAYOUTS)
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    monkeypatch.setattr(linear_autograd_mod, "linear",
                        lambda x, w, b=None, config=None: m_dependent_linear(x, w, b))
    for diff, equal in mismatch():  # padded and packed
        assert diff > 0 and equal is False


def test_moe_rows(results):
    rows = results["moe"]
    assert [(r["tokens"], r["implementation"]) for r in rows] == [
        (t, impl) for t in moe.QUICK_TOKENS for impl in moe.IMPLEMENTATIONS]
    layer = moe.QUICK_LAYER
    for row in rows:
        assert (row["hidden"], row["experts"], row["top_k"], row["intermediate"], row["dtype"]) == (
            layer["hidden_size"], layer["num_experts"], layer["num_experts_per_tok"], layer["moe_intermediate_size"],
            "bfloat16")
        if row["implementation"] == "invariant_fp8":  # the quick layer's widths are not multiples of 128
            assert row["skipped"].startswith("skipped: fp8 128x128 blocks need") and row["ms"] is None
            continue
        assert row["skipped"] is None and row["ms"] > 0 and row["tokens_per_s"] > 0
        assert row["alone_checked"] == len({0, row["tokens"] // 2, row["tokens"] - 1})
        assert row["max_abs_diff_to_eager"] < 0.05  # bf16 outputs of magnitude ~1
        if row["implementation"] == "invariant":
            assert row["alone_bitwise_equal"] is True and row["alone_max_abs_diff"] == 0.0
            assert row["invariant_time_ratio"] is None
        else:
            assert row["invariant_time_ratio"] > 0 and isinstance(row["alone_bitwise_equal"], bool)
    assert all(r["max_abs_diff_to_eager"] == 0.0 for r in rows if r["implementation"] == "eager")


def test_gdn_rows(results):
    rows = results["gdn"]
    cases = [("prefill", 1, t) for t in gdn.QUICK_PREFILL] + [("decode", b, gdn.QUICK_DECODE_CONTEXT)
                                                             for b in gdn.QUICK_DECODE_BATCHES]
    assert [(r["case"], r["sequences"], r["tokens"], r["implementation"]) for r in rows] == [
        (*case, impl) for case in cases for impl in gdn.IMPLEMENTATIONS]
    for row in rows:
        if row["implementation"] == "fla" and row["skipped"]:  # fla not installed
            continue
        assert row["skipped"] is None and row["ms"] > 0 and row["tokens_per_s"] > 0
        assert row["max_abs_diff_to_stock"] < 0.05  # bf16 outputs of magnitude ~1
        if row["implementation"] == "invariant":
            assert row["invariant_time_ratio"] is None
            assert row["decode_equals_prefill"] is (True if row["case"] == "decode" else None)
        else:
            assert row["invariant_time_ratio"] > 0


def test_gdn_model_rows(results, quick_run):
    """End to end on the tiny Qwen3.5 (a prompt past the 64-token chunk boundary): stock and
    invariant timed on the same weights, their last-token logits close (bf16)."""
    prefill, decode = results["gdn_prefill"], results["gdn_decode"]
    assert [(r["batch"], r["seq"]) for r in prefill] == list(gdn.QUICK_MODEL_PREFILL)
    assert [(r["batch"], r["prompt"], r["new_tokens"]) for r in decode] == list(gdn.QUICK_MODEL_DECODE)
    for row in prefill:
        assert row["preset"] == "qwen3_5_text:tiny" and row["stock_tokens_per_s"] > 0
        assert row["invariant_tokens_per_s"] > 0 and row["last_token_max_abs_diff"] < 0.1
    assert all(r["stock_decode_tokens_per_s"] > 0 and r["invariant_decode_tokens_per_s"] > 0 for r in decode)
    assert "End to end, a Qwen3.5 model" in quick_run[1]


def test_gdn_decode_check_catches_a_decode_from_another_boundary(monkeypatch):
    """Decode from a boundary the kernel's chunks do not have (48: the state there is the one at 0):
    decode_equals_prefill is False."""
    ctx = Run(device=torch.device("cpu"), quick=True)
    ctx.section = "gdn"
    monkeypatch.setattr(gdn, "CHUNK", 48)
    monkeypatch.setattr(gdn, "QUICK_PREFILL", ())
    rows = gdn.run(ctx)["gdn"]
    assert [r["decode_equals_prefill"] for r in rows if r["implementation"] == "invariant"] == [False, False]


def test_moe_fp8_experts_row_at_widths_of_128():
    """The invariant_fp8 row where fp8 blocks fit: it runs, a token alone is bitwise its row in the
    batch, and its output stays near eager's bf16 experts (the fp8 rounding)."""
    ctx = Run(device=torch.device("cpu"), quick=True)
    ctx.section = "moe"
    layer = dict(hidden_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    rows = {r["implementation"]: r for r in moe.run(ctx, layer=layer, tokens=(6,))["moe"]}
    fp8 = rows["invariant_fp8"]
    assert ctx.skipped == [] and fp8["skipped"] is None and fp8["invariant_time_ratio"] > 0
    assert fp8["alone_bitwise_equal"] is True and fp8["alone_max_abs_diff"] == 0.0
    assert 0 < fp8["max_abs_diff_to_eager"] < 0.25  # measured 0.13 (outputs of magnitude ~2)


def test_tensor_parallel_rows(results):
    exchange = results["tp_exchange"]  # qwen2.5-1.5b: 12 heads / 2 KV heads, so TP 2 only
    assert [(r["tp"], r["layer"], r["N"], r["K"], r["leaves"]) for r in exchange] == [
        (2, "o_proj", 1536, 1536, 8), (2, "down_proj", 1536, 8960, 8)]
    for row in exchange:  # (t-1)/t x 8 leaves x N x 4 bytes vs 2 (t-1)/t x N x 2
        assert row["ours_bytes_per_token"] == 0.5 * 8 * 1536 * 4 and row["stock_bf16_bytes_per_token"] == 2 * 0.5 * 1536 * 2
        assert row["ratio"] == 8.0 and row["ours_bytes_per_token_model"] == row["ours_bytes_per_token"] * 28
    steps = results["tp_steps"]
    assert [r["tp"] for r in steps] == [1, 2]
    for row in steps:
        assert row["prefill_step_ms"] > 0 and row["decode_step_ms"] > 0 and row["decode_ratio_to_tp1"] > 0
        assert row["bitwise_equal_to_tp1"] is True and row["steps"] == tp_bench.QUICK_DECODE


def test_tensor_parallel_check_catches_a_tp_dependent_exchange(monkeypatch):
    """The section's bitwise column fails when every rank all-reduces its own rounded sum."""
    import tp_controls
    from invariant_infer.model import tensor_parallel
    monkeypatch.setattr(tensor_parallel, "exchange_partials", tensor_parallel.exchange_partials)
    ctx = Run(device=torch.device("cpu"), quick=True)
    ctx.section = "tensor_parallel"
    steps = tp_bench.run(ctx, rank_init=tp_controls.use_allreduce_exchange)["tp_steps"]
    assert ctx.skipped == [] and [(r["tp"], r["bitwise_equal_to_tp1"]) for r in steps] == [(1, True), (2, False)]


def test_moe_alone_check_catches_an_m_dependent_expert_gemm(monkeypatch):
    """The section's alone check holds on the invariant kernels and fails when the grouped expert GEMM picks
    BLOCK_K by the largest expert's row count (a token alone: 1 row per expert, BLOCK_K 16; 32 tokens: more
    rows, BLOCK_K 64), and likewise when the router linear picks it by M. fp32, so that no bf16 rounding hides
    a changed sum."""
    def invariant_row():
        ctx = Run(device=torch.device("cpu"), quick=True)
        ctx.section = "moe"
        rows = moe.run(ctx, tokens=(32,), dtype=torch.float32)["moe"]
        assert ctx.skipped == [] and [r["implementation"] for r in rows] == list(moe.IMPLEMENTATIONS)
        return rows[0]["alone_bitwise_equal"], rows[0]["alone_max_abs_diff"]

    assert invariant_row() == (True, 0.0)
    with monkeypatch.context() as patched:
        patched.setattr(hf_experts, "grouped_linear", m_dependent_grouped_linear)
        equal, diff = invariant_row()
        assert equal is False and diff > 0
    monkeypatch.setattr(hf_experts, "linear", m_dependent_linear)
    equal, diff = invariant_row()
    assert equal is False and diff > 0


def test_quant_rows(results):
    """Quick quant rows: every (shape, format, M), bytes against bf16, invariant rows bitwise alone; no timings."""
    rows = results["quant"]
    shapes = quant.QUICK_SHAPES["tiny"]
    assert [(r["shape"], r["format"], r["M"]) for r in rows] == [
        (name, fmt, m) for name in shapes for fmt in quant.FORMATS for m in quant.QUICK_MS]
    ratios = {"fp8_block": 0.5, "fp8_channel": 0.5, "int4_w4a16": 0.25}  # plus the scales
    for row in rows:
        assert (row["N"], row["K"]) == shapes[row["shape"]] and row["bf16_weight_bytes"] == row["N"] * row["K"] * 2
        assert ratios[row["format"]] < row["bytes_ratio"] < ratios[row["format"]] + 0.01
        assert row["invariant_alone_bitwise_equal"] is True and isinstance(row["stock_alone_bitwise_equal"], bool)
        assert row["stock"] == quant.DECOMPRESS  # CPU: no torch._scaled_mm
        assert row["invariant_ms"] is row["stock_ms"] is row["ratio"] is None  # interpreter times: not recorded
        # fp8 quantizes activations (3 mantissa bits), the stock decompression path does not; int4 is weight-only
        assert row["invariant_max_abs_diff_to_stock"] < (0.01 if row["format"] == "int4_w4a16" else 0.25)


def test_quant_alone_check_catches_a_per_tensor_activation_scale(monkeypatch):
    """The section's alone check fails on fp8 rows when the activation scale is the max over the batch."""
    from benchmarks.fuzz_quantized import per_tensor_activations
    monkeypatch.setattr(quant, "quantize_activations", per_tensor_activations)
    monkeypatch.setattr(quant, "FORMATS", {"fp8_channel": "FP8_DYNAMIC"})
    ctx = Run(device=torch.device("cpu"), quick=True)
    ctx.section = "quant"
    rows = quant.run(ctx, ms=(1, 8))["quant"]
    assert ctx.skipped == [] and [r["M"] for r in rows] == [1, 8, 1, 8]
    assert [r["invariant_alone_bitwise_equal"] for r in rows] == [True, False, True, False]


def test_report_and_plots(quick_run):
    results, text, out, _ = quick_run
    assert "NOT meaningful" in text and "left-pad B=4 lens 33/20/9/1" in text
    for heading in ("## Divergence", "## Matmul", "## Scoring", "## Serving engine (qwen2:tiny",
                    "## Engine host overhead (qwen2:tiny", "## HTTP server (qwen2:tiny", "## Training step (qwen2:tiny",
                    "## One MoE layer (hidden 64, 8 experts, top-2", "## Quantized GEMMs", "## RMSNorm"):
        assert heading in text
    assert "analytic estimates, not measurements" in text and "÷ stock engine" in text and "| 2/2 |" in text
    assert "Host phases are meaningful on CPU" in text
    assert results["plots"] == list(PLOTS)
    for name in PLOTS:
        assert (out / name).stat().st_size > 10_000


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


def test_quick_run_for_a_llama_preset(tmp_path):
    """python -m benchmarks --quick --model-preset llama:llama-3.2-1b, the cheap sections, in-process."""
    rc = bench_main(["--quick", "--model-preset", "llama:llama-3.2-1b", "--only", "matmul,norm_attention",
                     "--out", str(tmp_path), "--no-plots"])
    results, text = json.loads((tmp_path / "results.json").read_text()), (tmp_path / "RESULTS.md").read_text()
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


def test_spec_rows(results):
    rows = results["spec"]  # code_edit (ngram) and free_text (a layer-skip draft), batch 1 and 2, off then on
    assert [(r["workload"], r["batch"], r["speculative"]) for r in rows] == [
        (w, b, s) for w in ("code_edit", "free_text") for b in (1, 2) for s in (False, True)]
    for plain, spec in zip(rows[::2], rows[1::2]):
        assert plain["bitwise_equal"] is spec["bitwise_equal"] is True
        assert plain["output_tokens"] == spec["output_tokens"] and spec["target_forwards"] <= plain["target_forwards"]
        assert spec["forwards_per_token"] == spec["target_forwards"] / spec["output_tokens"]
    draft = [r for r in rows if r["workload"] == "free_text" and r["speculative"]]
    assert all(r["draft_forwards"] > 0 and r["acceptance_length"] >= 1 for r in draft)


def test_lora_rows(results):
    from benchmarks import lora as lora_bench
    rows = results["lora"]  # the base model, then 1 and 2 adapters; engine prefill and decode, then PEFT's forward
    assert [(r["mode"], r["phase"], r["adapters"]) for r in rows] == [
        ("engine", p, n) for n in (0, *lora_bench.QUICK_ADAPTERS) for p in ("prefill", "decode")] + [
        ("peft_forward", "prefill", n) for n in (0, *lora_bench.QUICK_ADAPTERS)]
    requests, prompt, new = lora_bench.QUICK_REQUESTS, lora_bench.QUICK_PROMPT_TOKENS, lora_bench.QUICK_MAX_TOKENS
    for row in rows:
        assert (row["preset"], row["rank"], row["requests"]) == ("qwen2:tiny", lora_bench.QUICK_RANK, requests)
        assert row["tokens"] == (requests * (new - 1) if row["phase"] == "decode" else requests * prompt)
        assert row["tokens_per_s"] > 0 and row["time_ratio_to_base"] > 0
        if row["adapters"] == 0:
            assert row["time_ratio_to_base"] == 1.0
        if row["mode"] == "engine" and row["adapters"]:
            assert row["bitwise_rows_checked"] == requests == row["bitwise_rows_equal"]
        else:
            assert row["bitwise_rows_checked"] is None is row["bitwise_rows_equal"]


def test_lora_bits_catch_a_rows_dependent_shrink(monkeypatch):
    """The section's alone check fails when the LoRA shrink splits K by the rows sharing the adapter (vLLM's
    ``split_k``): the batch's prefill has 16 rows of adapter a0, a request alone 8. fp32, so that no bf16
    rounding hides a changed sum."""
    from benchmarks import lora as lora_bench
    from invariant_infer.engine import Engine
    from invariant_infer.kernels import LinearConfig, linear_config
    from invariant_infer.model import lora as lora_module
    ctx = Run(device=torch.device("cpu"), quick=True)
    config, _ = e2e.preset_config("qwen2", "tiny")
    _, sources = lora_bench.peft_adapters(ctx, config, torch.float32, 1, lora_bench.QUICK_RANK)
    engine = Engine(e2e.build_model(ctx, config, torch.float32), max_loras=1, max_lora_rank=lora_bench.QUICK_RANK,
                    enable_prefix_caching=False)  # as in the section: every run prefills every prompt
    engine.add_lora("a0", sources["a0"])
    prompts = engine_bench.random_prompts(2, (8, 8), config.vocab_size, lora_bench.PROMPT_SEED)

    def equal_rows():
        return lora_bench.bitwise_rows(engine, prompts, ["a0", "a0"], 1, [0, 1], {}, ctx.device)

    assert equal_rows() == 2

    def rows_dependent(device_type, dtype, rows, rank, k):
        base = linear_config(device_type, dtype, rank, k)
        return LinearConfig(base.block_m, base.block_n, 16, k_chunks=4 if rows < 12 else 1)
    monkeypatch.setattr(lora_module, "shrink_config", rows_dependent)
    assert equal_rows() < 2


def test_vlm_rows(results):
    """Quick vlm rows: the tower on each image count, prefill at each batch; the invariant rows bitwise alone."""
    rows = results["vlm"]
    assert [(r["case"], r["images"] if r["case"] == "tower" else r["batch"]) for r in rows] == [
        ("tower", n) for n in vlm.QUICK_IMAGES] + [("prefill", b) for b in vlm.QUICK_PREFILL]
    for row in rows:
        assert row["invariant_alone_bitwise_equal"] is True and row["side"] == vlm.QUICK_SIDE
        assert row["max_abs_diff_to_stock"] < 0.1 and row["ratio"] > 0  # bf16, the same weights



def test_embed_rows(results):
    """Quick embed rows: each model at each batch, invariant and stock side by side; the invariant embeddings
    alone equal those in the batch, bitwise, and stock's alone-vs-batch difference is reported (on CPU at these
    widths some of its rows are equal, so no sign is asserted; tests/benchmarks/test_embed.py has the control)."""
    names = [m.name for m in embed.MODELS]
    speed, drift = results["embed"], results["embed_divergence"]
    assert [(r["model"], r["batch"]) for r in speed] == [(n, b) for n in names for b in embed.QUICK_BATCHES]
    assert [(r["model"], r["batch"]) for r in drift] == [(n, b) for n in names for b in embed.QUICK_DIVERGENCE_BATCHES]
    for row in speed:
        assert (row["hidden"], row["layers"], row["dtype"]) == (64, 1, "bfloat16")
        assert row["stock_sequences_per_s"] > 0 and row["invariant_sequences_per_s"] > 0
        assert row["ratio"] == row["invariant_ms"] / row["stock_ms"] and row["throughput_ratio"] > 0
        assert row["max_abs_diff_to_stock"] < 0.05  # normalised bf16 embeddings, the same weights
    for row in drift:
        assert row["invariant_rows_checked"] == row["stock_rows_checked"] == embed.QUICK_CHECKED_ROWS
        assert row["invariant_max_abs_diff"] == 0.0 and row["invariant_rows_unequal"] == 0
        assert row["stock_max_abs_diff"] >= 0.0 and 0 <= row["stock_rows_unequal"] <= row["stock_rows_checked"]
