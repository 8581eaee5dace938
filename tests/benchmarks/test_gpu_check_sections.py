"""The GPU check's sections, in process and without a GPU: the plan's order and slices, the GPU-test
selection's verdicts on collection errors, a benchmark section's outcome as an exit status, the
golden digests computed part by part (one failing part recorded, the others kept), and the smoke
checks against batch-variant stand-ins of the kernels."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import invariant_infer.kernels as kernels  # noqa: E402
from benchmarks import golden_digests as golden  # noqa: E402
from benchmarks import gpu_check_smoke as smoke  # noqa: E402
from benchmarks.gpu_check_bench import outcome  # noqa: E402
from benchmarks.gpu_check_collect import _missing_module  # noqa: E402
from benchmarks.gpu_check_plan import REST, plan  # noqa: E402
from benchmarks.gpu_check_runner import NOT_APPLICABLE, OUT_OF_TIME  # noqa: E402
from benchmarks.gpu_check_tests import select  # noqa: E402
from helpers.controls import m_dependent_linear  # noqa: E402
from invariant_infer.kernels import AttentionConfig  # noqa: E402

DRY_RUN_SECTIONS = ["smoke", "gpu_tests", "check", "golden_digests", "ratios_matmul", "ratios_attention",
                    "ratios_quant", "ratios_e2e", "ratios_engine", "tensor_parallel", "rest_matmul", "preset_qwen3-8b"]


def test_the_plan_runs_the_sections_in_priority_order(tmp_path):
    dry = plan(tmp_path, tmp_path / "details", dry_run=True, extra_presets="qwen3:qwen3-8b", gpus=0)
    assert [s.name for s in dry] == DRY_RUN_SECTIONS
    gpu = plan(tmp_path, tmp_path / "details", dry_run=False, gpus=1, slices={"gpu_tests": 240})
    assert [s.name for s in gpu] == DRY_RUN_SECTIONS[:10] + [f"rest_{name}" for name in REST] + [
        "preset_qwen3-8b", "preset_llama-3.1-8b"]
    by_name = {s.name: s for s in gpu}
    assert by_name["gpu_tests"].slice_s == 240 and by_name["smoke"].argv[-2:] == ["--device", "cuda"]
    assert "--quick" not in by_name["ratios_matmul"].argv and "--quick" in {s.name: s for s in dry}["rest_matmul"].argv
    budget = by_name["ratios_e2e"].argv[by_name["ratios_e2e"].argv.index("--budget-s") + 1]
    assert 0 < float(budget) < by_name["ratios_e2e"].slice_s  # items stop before the slice's kill
    assert by_name["tensor_parallel"].precondition() == "tensor parallelism needs two or more GPUs (found 1)"
    for name, section in (("ratios_quant", "quant"), ("preset_llama-3.1-8b", "matmul")):  # headline items
        argv = by_name[name].argv
        assert argv[argv.index("benchmarks.gpu_check_bench") + 1] == section
        assert argv[argv.index("--items") + 1] == "headline"
    two = {s.name: s for s in plan(tmp_path, tmp_path, dry_run=False, gpus=2)}
    assert two["tensor_parallel"].precondition() is None


def test_selection_leaves_out_files_missing_a_third_party_module_only(tmp_path):
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    collected = {"selected": ["tests/a/test_x.py::test_gpu[cuda]", "tests/a/test_x.py::test_other",
                              "tests/test_y.py::t"],
                 "collection_errors": [
                     {"file": str(tmp_path / "tests/test_serve.py"), "missing_module": "fastapi", "error": "E"},
                     {"file": str(tmp_path / "tests/test_lm.py"), "missing_module": "lm_eval.api", "error": "E"},
                     {"file": str(tmp_path / "tests/test_local.py"), "missing_module": "helpers.gone", "error": "E"},
                     {"file": str(tmp_path / "tests/test_syntax.py"), "missing_module": None, "error": "SyntaxError"}]}
    got = select(collected, tmp_path, tmp_path / "tests")
    assert got["tests_selected"] == 3 and got["test_files"] == ["tests/a/test_x.py", "tests/test_y.py"]
    assert got["left_out"] == [{"file": "tests/test_serve.py", "missing_module": "fastapi"},
                               {"file": "tests/test_lm.py", "missing_module": "lm_eval.api"}]
    assert [e["file"] for e in got["collection_errors"]] == ["tests/test_local.py", "tests/test_syntax.py"]


def test_missing_module_follows_the_cause_chain():
    try:
        try:
            import a_module_no_machine_has  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("collection failed") from exc
    except RuntimeError as outer:
        assert _missing_module(outer) == "a_module_no_machine_has"
    assert _missing_module(ValueError("x")) is None


def _results(**sections):
    return {"skipped": sections.pop("skipped", []), "sections": ["x"], **sections}


@pytest.mark.parametrize("results, rc, status, reason", [
    (_results(matmul=[{"M": 1}]), 0, 0, None),
    (_results(lora=[], skipped=[{"item": "lora", "reason": "ModuleNotFoundError: No module named 'peft'",
                                 "missing_module": "peft"}]), 0, NOT_APPLICABLE, "needs peft (not installed)"),
    (_results(e2e=[{"batch": 1}], skipped=[{"item": "e2e 8x2048", "reason": "RuntimeError: CUDA error"}]), 0, 1,
     "1 item(s) raised; first: e2e 8x2048: RuntimeError: CUDA error"),
    (_results(e2e=[], skipped=[{"item": "x", "reason": "ModuleNotFoundError: No module named 'invariant_infer.gone'",
                                "missing_module": "invariant_infer.gone"}]), 0, 1, "1 item(s) raised"),
    (_results(matmul=[], skipped=[{"item": "q M=1", "reason": "time budget"}]), 0, OUT_OF_TIME,
     "the time budget ended before any item ran"),
    (_results(scoring_memory=[{"tokens": 1}],
              skipped=[{"item": "T=16384 naive", "reason": "skipped: would need 9 GB (free 5 GB)"}]), 0, 0, None),
    (_results(tp_steps=[{"tp": 1, "bitwise_equal_to_tp1": True}, {"tp": 2, "bitwise_equal_to_tp1": False}]), 0, 1,
     "tensor parallelism: TP [2] not bitwise equal to TP 1"),
    (_results(matmul=[{"M": 1}]), 1, 1, "python -m benchmarks exited 1"),
])
def test_a_benchmark_sections_outcome(results, rc, status, reason):
    got, fields = outcome(results, rc)
    assert got == status and (reason is None or fields["reason"].startswith(reason))


def test_golden_digests_go_on_past_a_failing_part(tmp_path, monkeypatch):
    def family_digests(family, dtype_name, device, path, engine):
        if family == "qwen2":
            raise RuntimeError("illegal memory access")
        return {f"{family}/{dtype_name}/alone": "ab" * 32}
    monkeypatch.setattr(golden, "_family_digests", family_digests)
    out = tmp_path / "entry.json"
    digests, errors, attempted = golden.compute_into("cpu", out, families=["qwen2", "llama"], dtypes=["bf16"])
    assert digests == {"llama/bf16/alone": "ab" * 32} and attempted == {"qwen2/bf16", "llama/bf16"}
    assert errors == {"qwen2/bf16": "RuntimeError: illegal memory access"}
    entry = json.loads(out.read_text())["cpu-interpreter"]
    assert entry["digests"] == digests and entry["errors"] == errors
    assert golden.main(["--families", "qwen2,llama", "--dtypes", "bf16", "--out", str(tmp_path / "again.json")]) == 1
    saved = []
    monkeypatch.setattr(golden, "save", lambda entries, path=None: saved.append(path))
    with pytest.raises(SystemExit):  # an entry with a failed part is not merged
        golden.main(["--merge", str(out)])
    assert saved == []


def test_golden_digests_compare_only_the_parts_computed(monkeypatch, capsys):
    recorded = golden.load()["cpu-interpreter"]["digests"]
    monkeypatch.setattr(golden, "_family_digests", lambda family, dtype_name, device, path, engine: {
        k: v for k, v in recorded.items() if golden.part_of(k) == f"{family}/{dtype_name}"})
    assert golden.main(["--families", "llama", "--dtypes", "fp32"]) == 0
    assert "digests of 'cpu-interpreter' equal the committed ones" in capsys.readouterr().out
    monkeypatch.setattr(golden, "_family_digests", lambda family, dtype_name, device, path, engine: {
        k: "0" * 64 for k, v in recorded.items() if golden.part_of(k) == f"{family}/{dtype_name}"})
    assert golden.main(["--families", "llama", "--dtypes", "fp32"]) == 1
    assert "moved:   llama/fp32/alone" in capsys.readouterr().out


def test_smoke_checks_catch_batch_variant_kernels(monkeypatch):
    """Negative controls of the smoke section (which the dry run in test_gpu_check.py passes)."""
    cpu, shapes = torch.device("cpu"), smoke.SHAPES["cpu"]
    assert smoke.pinned_options_problem() is None
    monkeypatch.setattr(kernels, "linear", m_dependent_linear)  # BLOCK_K by M
    assert not smoke.linear_row_alone_equal(cpu, shapes["linear"], "fp32")
    attention = kernels.attention

    def kv_block_by_batch(q, k, v, *args, **kwargs):
        return attention(q, k, v, *args, config=AttentionConfig(32, 16 if q.shape[0] > 1 else 64), **kwargs)
    monkeypatch.setattr(kernels, "attention", kv_block_by_batch)
    assert not smoke.attention_row_alone_equal(cpu, shapes["attention"], "bf16")
    record = {"pinned_options_accepted": True, **{f"{n}_{d}_row_alone_equal": True for n in smoke.CHECKS
                                                  for d in smoke.DTYPES}}
    assert smoke.passed(record) and not smoke.passed({**record, "attention_fp32_row_alone_equal": None})


def test_a_benchmark_section_cut_short_stops_its_items_in_time(monkeypatch, tmp_path):
    """The runner cuts a slice to what is left of TOTAL_S and says so in GPU_CHECK_TIMEOUT_S: the
    benchmark's budget follows (less its margin), so it writes its rows before it is killed. Control:
    without the variable, the planned budget stands."""
    import benchmarks.__main__ as bench_entry
    from benchmarks import gpu_check_bench

    budgets = []
    monkeypatch.setattr(bench_entry, "main", lambda argv: budgets.append(float(argv[argv.index("--budget-s") + 1])))
    argv = ["matmul", "--out", str(tmp_path), "--budget-s", "90", "--margin-s", "30"]
    monkeypatch.setenv("GPU_CHECK_TIMEOUT_S", "45")
    gpu_check_bench.main(argv)
    monkeypatch.delenv("GPU_CHECK_TIMEOUT_S")
    gpu_check_bench.main(argv)
    assert budgets == [15.0, 90.0]
