"""The GPU check's section runner: each section is one command in its own process group, with its own
time slice out of one total budget, and ``sections.json`` is rewritten after each one ends.

A section's status is one of:
  * ``ok``: its command exited 0;
  * ``failed``: it exited with any other status (``reason``: its own, else its log's last line);
  * ``timeout``: it overran its slice and its process group was killed, or it exited ``OUT_OF_TIME``
    (it measured nothing in the time it had);
  * ``skipped``: it cannot apply here (its ``precondition`` says why, or it exited ``NOT_APPLICABLE``;
    e.g. tensor parallelism on one GPU; ``not_applicable`` is set), or less than its ``min_s`` was
    left of the budget when its turn came (``reason`` says so).

A section's command may add fields to its record: it writes a JSON object to the file named by the
environment variable ``GPU_CHECK_RECORD`` (``reason``, counts, ...). So may the section's ``fields``
callable, run here after the command ends (it reads what the command wrote).
Separate processes: a CUDA fault, a hang or a leaked child of one section cannot reach the next.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

STATUSES = ("ok", "failed", "timeout", "skipped")
NOT_APPLICABLE = 77  # automake's "skipped" status
OUT_OF_TIME = 124    # timeout(1)'s status
KILL_GRACE_S = 5.0   # SIGTERM, then SIGKILL this much later
TIMEOUT_ENV = "GPU_CHECK_TIMEOUT_S"
RECORD_ENV = "GPU_CHECK_RECORD"
PENDING_REASON = "not run: the check stopped before this section ended"
_OWN_FIELDS = ("name", "status", "seconds", "rc", "log")


@dataclass
class Section:
    """One step of the check: ``argv`` run in ``cwd`` for at most ``slice_s`` seconds."""
    name: str
    argv: list
    slice_s: float
    min_s: float = 5.0                       # skipped when less than this is left of the budget
    env: dict = field(default_factory=dict)  # added to the runner's environment
    fields: Callable[[], dict] | None = None  # extra record fields, read after the command ends
    precondition: Callable[[], str | None] | None = None  # why it cannot apply here (then not run), or None


def write_json_atomic(path: Path, value) -> None:
    """Write to a temporary file beside ``path``, then rename: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def last_line(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is empty
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the section's process group, then SIGKILL whatever of it is left after the grace period."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # stuck in the driver: leave it, the next section runs anyway
        pass


def run_one(section: Section, log: Path, timeout_s: float, cwd: Path, record_path: Path) -> dict:
    """Run ``section`` with output to ``log``; its record (status from the exit status and time)."""
    # TIMEOUT_ENV: the seconds this run of the section really has (its slice, cut to what is left)
    env = {**os.environ, **section.env, RECORD_ENV: str(record_path), TIMEOUT_ENV: f"{timeout_s:.1f}"}
    record_path.unlink(missing_ok=True)
    started = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {' '.join(map(str, section.argv))}\n")
        out.flush()
        proc = subprocess.Popen([str(a) for a in section.argv], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out, rc = False, None
        try:
            rc = proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # the runner is stopped: the section goes with it
            _kill_group(proc)
            raise
        if timed_out:
            _kill_group(proc)
        else:  # the leader exited: end any child it left in its group (a server, a rank)
            _signal_group(proc.pid, signal.SIGKILL)
    seconds = round(time.monotonic() - started, 1)
    record = {"name": section.name, "seconds": seconds, "rc": None if timed_out else rc, "log": log.name}
    if timed_out:
        record.update(status="timeout", reason=f"overran its slice of {timeout_s:.3g} s; its processes were killed")
    elif rc == 0:
        record["status"] = "ok"
    elif rc == NOT_APPLICABLE:
        record.update(status="skipped", not_applicable=True)
    elif rc == OUT_OF_TIME:
        record["status"] = "timeout"
    else:
        record["status"] = "failed"
    extra = {}
    try:
        extra.update(json.loads(record_path.read_text()))
    except (OSError, ValueError):
        pass
    if section.fields is not None:
        try:
            extra.update(section.fields())
        except Exception as exc:  # the record must be written whatever the section left
            extra["fields_error"] = f"{type(exc).__name__}: {exc}"[:300]
    record.update({k: v for k, v in extra.items() if k not in _OWN_FIELDS})
    if record["status"] != "ok" and not record.get("reason"):
        record["reason"] = last_line(log) or f"exit status {rc}"
    return record


class Stopped(Exception):
    """SIGTERM or SIGINT reached the runner."""


def run_sections(sections: list[Section], dest: Path, log_dir: Path, total_s: float, cwd: Path,
                 on_update: Callable[[list], None] | None = None) -> list[dict]:
    """Run ``sections`` in order within ``total_s`` seconds from now. ``dest/sections.json`` lists every
    section, rewritten before the first one and after each one ends (sections not yet run read as
    skipped, with ``PENDING_REASON``). Returns the records."""
    start = time.monotonic()
    deadline = start + total_s
    records = [{"name": s.name, "status": "skipped", "seconds": 0.0, "rc": None, "log": None,
                "reason": PENDING_REASON} for s in sections]
    sections_json = dest / "sections.json"

    def publish():
        write_json_atomic(sections_json, records)
        if on_update is not None:
            on_update(records)

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        publish()
        for i, section in enumerate(sections):
            left = deadline - time.monotonic()
            why_not = section.precondition() if section.precondition else None
            if why_not:
                records[i] = {"name": section.name, "status": "skipped", "seconds": 0.0, "rc": None, "log": None,
                              "reason": why_not, "not_applicable": True}
            elif left < section.min_s:
                records[i] = {"name": section.name, "status": "skipped", "seconds": 0.0, "rc": None, "log": None,
                              "reason": f"no time left: {max(left, 0):.0f} s of TOTAL_S={total_s:.0f} remained, "
                                        f"it needs at least {section.min_s:.0f} s"}
            else:
                timeout = min(section.slice_s, left)
                print(f"[gpu_check] {section.name}: up to {timeout:.0f} s ({time.monotonic() - start:.0f} s "
                      f"elapsed)", flush=True)
                records[i] = run_one(section, log_dir / f"{section.name}.log", timeout, cwd,
                                     log_dir / f".{section.name}.record.json")
                print(f"[gpu_check] {section.name}: {records[i]['status']} in {records[i]['seconds']} s"
                      + (f" ({records[i]['reason']})" if records[i].get("reason") else ""), flush=True)
            publish()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        write_json_atomic(sections_json, records)
    return records
