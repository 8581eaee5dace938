"""The GPU check's section runner (``benchmarks/gpu_check_runner.py``) on tiny fake sections: a section
that overruns its slice is killed with its whole process group and recorded ``timeout``, a failing
one ``failed``, both followed by the next section; sections the budget no longer covers are
``skipped``; ``sections.json`` is complete and valid whenever a section runs."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import gpu_check_runner as runner  # noqa: E402
from benchmarks.gpu_check import passed  # noqa: E402
from benchmarks.gpu_check_runner import PENDING_REASON, STATUSES, Section, run_sections  # noqa: E402

PY = sys.executable


def py(code: str) -> list:
    return [PY, "-S", "-c", code]


def run(tmp_path: Path, sections: list, total_s: float = 60.0) -> list[dict]:
    records = run_sections(sections, tmp_path, tmp_path, total_s, tmp_path)
    assert json.loads((tmp_path / "sections.json").read_text()) == records
    return records


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_section_over_its_slice_is_killed_with_its_children_and_the_next_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "KILL_GRACE_S", 1.0)
    pids = tmp_path / "pids"
    hang = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-S', '-c', "
            "'import time; time.sleep(60)']); "
            f"open({str(pids)!r}, 'w').write(f'{{__import__(\"os\").getpid()}} {{child.pid}}'); time.sleep(60)")
    started = time.monotonic()
    records = run(tmp_path, [Section("hang", py(hang), slice_s=1.5), Section("after", py("print('ran')"), 5.0)])
    assert time.monotonic() - started < 15
    assert [r["status"] for r in records] == ["timeout", "ok"]
    assert records[0]["rc"] is None and "overran its slice of 1.5 s" in records[0]["reason"]
    assert (tmp_path / "after.log").read_text().endswith("ran\n")
    time.sleep(0.2)
    assert not any(alive(int(pid)) for pid in pids.read_text().split())  # the leader and its child


def test_a_failing_section_is_failed_with_its_reason_and_the_next_runs(tmp_path):
    records = run(tmp_path, [Section("boom", py("import sys; print('the kernel faulted'); sys.exit(3)"), 5.0),
                             Section("after", py("pass"), 5.0)])
    assert [(r["status"], r["rc"]) for r in records] == [("failed", 3), ("ok", 0)]
    assert records[0]["reason"] == "the kernel faulted" and records[0]["log"] == "boom.log"


def test_sections_beyond_the_budget_are_skipped(tmp_path):
    records = run(tmp_path, [Section("long", py("import time; time.sleep(30)"), slice_s=30.0, min_s=0.1),
                             Section("late", py("pass"), 5.0, min_s=1.0),
                             Section("later", py("pass"), 5.0, min_s=1.0)], total_s=1.2)
    assert [r["status"] for r in records] == ["timeout", "skipped", "skipped"]
    cut_to = float(re.search(r"overran its slice of ([\d.]+) s", records[0]["reason"]).group(1))
    assert cut_to <= 1.2 and records[0]["seconds"] < 5  # its slice of 30 s, cut to what was left
    assert all(r["reason"].startswith("no time left") and not r.get("not_applicable") for r in records[1:])
    assert not passed(records, dry_run=True) and not passed(records, dry_run=False)


def test_sections_json_is_complete_and_valid_while_each_section_runs(tmp_path):
    """Each section copies sections.json as it stands while it runs: the sections before it carry
    their final records, it and the ones after read as not run yet."""
    def copier(i, exit_code=0):
        return py(f"import shutil, sys; shutil.copy({str(tmp_path / 'sections.json')!r}, "
                  f"{str(tmp_path / f'seen{i}.json')!r}); sys.exit({exit_code})")
    sections = [Section("a", copier(0), 5.0), Section("b", copier(1, exit_code=1), 5.0),
                Section("c", copier(2), 5.0)]
    final = run(tmp_path, sections)
    assert [r["status"] for r in final] == ["ok", "failed", "ok"]
    for i in range(3):
        seen = json.loads((tmp_path / f"seen{i}.json").read_text())
        assert [r["name"] for r in seen] == ["a", "b", "c"]
        assert seen[:i] == final[:i]
        assert all(r["status"] == "skipped" and r["reason"] == PENDING_REASON for r in seen[i:])
        assert all(set(r) >= {"name", "status", "seconds", "rc", "log"} and r["status"] in STATUSES for r in seen)


def test_not_applicable_sections_and_the_records_they_write(tmp_path):
    write = ("import json, os, sys; json.dump({'reason': 'needs two GPUs', 'tests_selected': 4, "
             "'status': 'ok', 'name': 'x'}, open(os.environ['GPU_CHECK_RECORD'], 'w')); sys.exit(77)")
    records = run(tmp_path, [Section("tp", py(write), 5.0),
                             Section("pre", py("raise SystemExit(1)"), 5.0, precondition=lambda: "no GPU here"),
                             Section("fields", py("pass"), 5.0, fields=lambda: {"digests": 7})])
    assert [(r["name"], r["status"], r.get("not_applicable")) for r in records] == [
        ("tp", "skipped", True), ("pre", "skipped", True), ("fields", "ok", None)]
    assert records[0]["reason"] == "needs two GPUs" and records[0]["tests_selected"] == 4  # own fields kept
    assert records[1]["reason"] == "no GPU here" and records[1]["log"] is None and records[2]["digests"] == 7
    assert passed(records, dry_run=True) and passed(records, dry_run=False)


@pytest.mark.parametrize("status, dry_run_passes, gpu_run_passes", [
    ("failed", False, False), ("timeout", False, False), ("skipped", False, True), ("ok", True, True)])
def test_exit_status_rules(status, dry_run_passes, gpu_run_passes):
    records = [{"name": "a", "status": "ok"}, {"name": "b", "status": status, "reason": "no time left"}]
    assert passed(records, dry_run=True) is dry_run_passes and passed(records, dry_run=False) is gpu_run_passes
