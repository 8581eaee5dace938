"""A pytest plugin for the GPU check's test section (``pytest -p benchmarks.gpu_check_collect``): it
writes what pytest selected and how each test went to the JSON file named by ``GPU_CHECK_PYTEST_OUT``,
rewritten as the run goes, so a run killed midway leaves its counts and the test it was in.

The file holds: ``selected`` (node ids left after ``-m``), ``collection_errors`` (one per file, or
folder whose conftest.py failed to import, that could not be collected: ``file``, ``missing_module``
when the cause was a ModuleNotFoundError, ``error``), ``counts`` (passed, failed, skipped, error,
xfailed: per outcome) and ``running`` (the node id of the test in progress, None between tests).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

OUT_ENV = "GPU_CHECK_PYTEST_OUT"
# "No module named 'x'"; "import of x halted; None in sys.modules" where x was blocked on purpose
_NOT_FOUND = re.compile(r"ModuleNotFoundError: (?:No module named '([\w.]+)'|import of ([\w.]+) halted)")
_state = {"selected": [], "collection_errors": [], "counts": {}, "running": None}


def _write() -> None:
    out = os.environ.get(OUT_ENV)
    if out:
        path = Path(out)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(_state, indent=1) + "\n")
        os.replace(tmp, path)


def _missing_module(exc: BaseException | None) -> str | None:
    """The name of the module whose absence caused ``exc`` (following __cause__ / __context__)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            return exc.name
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    text = str(report.longrepr)
    if isinstance(collector, pytest.Module):
        try:  # import it again to see the exception pytest turned into text
            collector.obj  # noqa: B018
            missing = None
        except BaseException as exc:  # pytest's CollectError, raised from the import's own error
            missing = _missing_module(exc)
    else:  # a folder whose conftest.py failed to import: pytest's text is all there is
        found = _NOT_FOUND.findall(text)
        missing = "".join(found[-1]) if found else None
    _state["collection_errors"].append({"file": str(collector.path), "missing_module": missing,
                                        "error": text.strip().splitlines()[-1][:300] if text.strip() else ""})
    _write()


def pytest_collection_finish(session):
    _state["selected"] = [item.nodeid for item in session.items]
    _write()


def pytest_runtest_logstart(nodeid, location):
    _state["running"] = nodeid
    _write()


def pytest_runtest_logreport(report):
    outcome = None
    if report.when == "call":
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    elif report.failed:  # setup or teardown raised
        outcome = "error"
    elif report.skipped and report.when == "setup":
        outcome = "skipped"
    if outcome:
        _state["counts"][outcome] = _state["counts"].get(outcome, 0) + 1
        _write()


def pytest_runtest_logfinish(nodeid, location):
    _state["running"] = None
    _write()
