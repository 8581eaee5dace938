"""The GPU check's test section: every test marked ``gpu`` under ``tests/``, in the files this
machine can import.

    python -m benchmarks.gpu_check_tests --out DIR [--root DIR] [--tests tests] [--marker gpu] [--select-only]

Selection is derived, not listed: ``pytest --collect-only -m gpu`` over the whole tree (with the
``gpu_check_collect`` plugin, ``--continue-on-collection-errors``). A file whose import fails
with ModuleNotFoundError for a module that is not part of this checkout (an optional extra the
machine lacks: fastapi, ray, lm_eval, trl ...), or a folder whose conftest.py does, is left out and
listed with the missing module; any
other collection error fails the section (after the selected tests have run). Then one pytest
process runs ``-m gpu`` over the files that hold selected tests (one process: one GPU).

Record (``GPU_CHECK_RECORD``): ``tests_selected`` (GPU test cases selected), ``test_files``,
``left_out`` ([{file, missing_module}]), ``collection_errors``. The run's counts are written as it
goes to DIR/run.json (see ``gpu_check_collect``). Exit status 0 when the tests passed or were
skipped (on CPU every GPU test skips) and nothing else failed to collect; 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "benchmarks.gpu_check_collect"


def pytest_argv(marker: str, *paths, collect_only: bool = False) -> list[str]:
    """pytest in this interpreter, without the project's addopts (two xdist workers, -m 'not heavy'):
    every test of the marker, heavy or not, in one process."""
    return [sys.executable, "-m", "pytest", *(["--collect-only"] if collect_only else []), "-q", "-rs",
            "-m", marker, "-p", "no:cacheprovider", "-o", "addopts=", "-p", PLUGIN,
            "--continue-on-collection-errors", *map(str, paths)]


def is_local(module: str, root: Path, tests: Path) -> bool:
    """A module of this checkout (the package, the benchmarks, the tests' helpers), not a third-party one."""
    top = module.split(".")[0]
    return any((base / top).exists() or (base / f"{top}.py").exists() for base in (root, tests))


def select(collected: dict, root: Path, tests: Path) -> dict:
    """The selection from the collect-only run's file: test files holding selected tests, the files
    left out for a missing third-party module, and the other collection errors."""
    left_out, errors = [], []
    for err in collected["collection_errors"]:
        missing = err.get("missing_module")
        file = os.path.relpath(err["file"], root)
        if missing and not is_local(missing, root, tests):
            left_out.append({"file": file, "missing_module": missing})
        else:
            errors.append({"file": file, "error": err.get("error", "")})
    files = sorted({nodeid.split("::")[0] for nodeid in collected["selected"]})
    return {"tests_selected": len(collected["selected"]), "test_files": files, "left_out": left_out,
            "collection_errors": errors}


def write_record(record: dict) -> None:
    out = os.environ.get("GPU_CHECK_RECORD")
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_tests", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for collect.json and run.json")
    parser.add_argument("--root", type=Path, default=ROOT, help="where pytest runs (the rootdir)")
    parser.add_argument("--tests", default="tests", help="the test tree, relative to --root")
    parser.add_argument("--marker", default="gpu")
    parser.add_argument("--select-only", action="store_true", help="stop after the selection (its record)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    root, out = args.root.resolve(), args.out.resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    collect_json = out / "collect.json"
    print(f"[gpu_tests] selecting: pytest --collect-only -m {args.marker} {args.tests}", flush=True)
    collect = subprocess.run(pytest_argv(args.marker, args.tests, collect_only=True), cwd=root,
                             env={**env, "GPU_CHECK_PYTEST_OUT": str(collect_json)}, capture_output=True, text=True)
    (out / "collect.log").write_text(collect.stdout + collect.stderr)
    try:
        collected = json.loads(collect_json.read_text())
    except (OSError, ValueError):
        write_record({"tests_selected": 0, "reason": "collection wrote no selection: " +
                      (collect.stdout + collect.stderr).strip()[-300:]})
        print(collect.stdout + collect.stderr)
        return 1
    record = select(collected, root, root / args.tests)
    print(f"[gpu_tests] {record['tests_selected']} tests selected in {len(record['test_files'])} files; left out "
          f"(missing modules): {record['left_out'] or 'none'}; other collection errors: "
          f"{record['collection_errors'] or 'none'}", flush=True)
    if not record["tests_selected"]:
        write_record({**record, "reason": f"no test marked {args.marker!r} was selected"})
        return 1
    if record["collection_errors"]:
        record["reason"] = f"{len(record['collection_errors'])} test file(s) failed to collect: " + ", ".join(
            e["file"] for e in record["collection_errors"])
    write_record(record)
    if args.select_only:
        return 1 if record["collection_errors"] else 0

    run = subprocess.run(pytest_argv(args.marker, *record["test_files"]), cwd=root,
                         env={**env, "GPU_CHECK_PYTEST_OUT": str(out / "run.json")})
    if run.returncode not in (0, 1):
        print(f"[gpu_tests] pytest exited {run.returncode}", flush=True)
    return 0 if run.returncode == 0 and not record["collection_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
