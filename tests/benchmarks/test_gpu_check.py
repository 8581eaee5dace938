"""``bash benchmarks/gpu_check.sh --dry-run`` as CI runs it (CPU, Triton interpreter, tiny shapes), with the
packages the GPU image lacks made unimportable, as a GPU machine sees the tree: every kind of section runs
for real and passes, the records and the summary are complete, the GPU-test selection leaves out (and
names) only the files needing those packages; and the selection on a small test tree with a file that
needs a missing package and one that cannot be collected."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_check_runner import STATUSES  # noqa: E402

pytestmark = [pytest.mark.heavy, pytest.mark.file_minutes(2.5)]  # measured on 2 cores: start it early

DRY_RUN_TIMEOUT_S = 900
GPU_IMAGE_LACKS = ("fastapi", "uvicorn", "prometheus_client", "openai", "ray", "lm_eval", "trl", "peft",
                   "compressed_tensors")
EXPECTED = ["smoke", "gpu_tests", "check", "golden_digests", "ratios_matmul", "ratios_attention", "ratios_quant",
            "ratios_e2e", "ratios_engine", "tensor_parallel", "rest_matmul", "preset_qwen3-8b"]


def run_to_end(argv, env, cwd, timeout):
    """Run ``argv`` in its own session; on a timeout or an error here, SIGTERM it (the check then ends
    the section it is in), then SIGKILL whatever is left of its group."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def gpu_image_site(folder: Path) -> Path:
    """A sitecustomize.py that makes the packages the GPU image lacks unimportable (import x: not found)."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({list(GPU_IMAGE_LACKS)!r}))\n")
    return folder


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k not in ("TOTAL_S", "ONLY", "SLICES", "EXTRA_PRESETS",
                                                            "DETAILS_DIR")}
    site = gpu_image_site(tmp_path_factory.mktemp("gpu-image") / "site")
    env.update(OUT=str(out), PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    rc, log = run_to_end(["bash", "benchmarks/gpu_check.sh", "--dry-run"], env, ROOT, DRY_RUN_TIMEOUT_S)
    return rc, log, out


def test_dry_run_passes_with_every_section_recorded(dry_run):
    rc, log, out = dry_run
    records = json.loads((out / "sections.json").read_text())
    assert rc == 0, log[-4000:]
    assert isinstance(records, list) and [r["name"] for r in records] == EXPECTED
    for record in records:
        assert {"name", "status", "seconds", "rc", "log"} <= set(record) and record["status"] in STATUSES
        assert record["status"] == "ok" or (record["status"] == "skipped" and record["not_applicable"]), record
    by_name = {r["name"]: r for r in records}
    assert by_name["tensor_parallel"]["reason"] == "tensor parallelism needs two or more GPUs (found 0)"
    tests = by_name["gpu_tests"]  # the tree as the GPU image sees it: the files needing its missing packages left out
    assert tests["tests_selected"] > 0 and tests["collection_errors"] == [] and tests["left_out"]
    assert {e["missing_module"].split(".")[0] for e in tests["left_out"]} <= set(GPU_IMAGE_LACKS)
    assert "tests/server" in {e["file"] for e in tests["left_out"]}  # its conftest.py imports openai
    assert tests["counts"] == {"skipped": tests["tests_selected"]}  # every GPU test selected, skipped on CPU
    assert by_name["golden_digests"]["digests"] > 0 and by_name["golden_digests"]["part_errors"] == {}
    for name in ("ratios_matmul", "ratios_attention", "ratios_quant", "ratios_e2e", "ratios_engine", "rest_matmul"):
        assert by_name[name]["rows"] > 0 and by_name[name]["failed_items"] == 0
    with tarfile.open(out / "details.tar.gz") as tar:
        smoke_log = tar.extractfile("details/smoke.log").read().decode()
    smoke = json.loads(smoke_log.split("\n", 1)[1])
    assert smoke["linear_bf16_row_alone_equal"] is smoke["attention_fp32_row_alone_equal"] is True


def test_dry_run_outputs(dry_run):
    _, _, out = dry_run
    summary = (out / "summary.md").read_text()
    assert "| section | status | seconds | rc | notes |" in summary and "| gpu_tests | ok |" in summary
    ratios = summary.split("## Headline ratios")[1].split("\n## ")[0]
    assert "| section | item | stock | invariant | invariant/stock time | bits |" in ratios
    for item in ("| ratios_matmul | GEMM q M=1 ", "| ratios_attention | attention prefill", "| ratios_attention | "
                 "attention decode", "| ratios_e2e | e2e scoring", "| ratios_e2e | e2e decode",
                 "| ratios_engine | engine c=4", "| ratios_quant | fp8_channel GEMM gate/up M=1 ",
                 "paged_attention vs sdpa", "flash_attn not importable", "| paged = attention: yes |"):
        assert item in ratios
    assert "commit: " in (out / "commit.txt").read_text() and "torch: " in (out / "commit.txt").read_text()
    assert "cpu-interpreter" in json.loads((out / "golden_digests.json").read_text())
    with tarfile.open(out / "details.tar.gz") as tar:
        names = tar.getnames()
    assert {f"details/{name}.log" for name in EXPECTED if name != "tensor_parallel"} <= set(names)
    # what a lent GPU machine hands back: at most 8 files of $OUT, no more than 2 folders down
    files = [path.relative_to(out) for path in out.rglob("*") if path.is_file()]
    assert len(files) <= 8 and all(len(path.parts) <= 3 for path in files), files


def test_gpu_test_selection_on_a_small_tree(tmp_path):
    """A file importing a package nobody has is left out and named; the others' gpu tests run; a file
    that cannot be collected for another reason fails the section after the run."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tests / "test_plain.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n\n"
                                         "def test_cpu():\n    pass\n")
    (tests / "test_extra.py").write_text("import a_package_nobody_has\nimport pytest\n\n@pytest.mark.gpu\n"
                                         "def test_gpu():\n    pass\n")
    (tests / "served").mkdir()  # a folder whose conftest.py needs a missing package (as tests/server needs openai)
    (tests / "served" / "conftest.py").write_text("import another_package_nobody_has\n")
    (tests / "served" / "test_served.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n")
    record = tmp_path / "record.json"
    argv = [sys.executable, "-m", "benchmarks.gpu_check_tests", "--out", str(tmp_path / "out"), "--root",
            str(tmp_path)]
    env = {**os.environ, "GPU_CHECK_RECORD": str(record), "PYTHONPATH": str(ROOT)}
    assert subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, timeout=120).returncode == 0
    got = json.loads(record.read_text())
    assert got["tests_selected"] == 1 and got["test_files"] == ["tests/test_plain.py"]
    assert sorted(got["left_out"], key=lambda e: e["file"]) == [
        {"file": "tests/served", "missing_module": "another_package_nobody_has"},
        {"file": "tests/test_extra.py", "missing_module": "a_package_nobody_has"}]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["counts"] == {"passed": 1}
    (tests / "test_broken.py").write_text("def broken(:\n")
    assert subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, timeout=120).returncode == 1
    got = json.loads(record.read_text())
    assert [e["file"] for e in got["collection_errors"]] == ["tests/test_broken.py"] and got["tests_selected"] == 1
