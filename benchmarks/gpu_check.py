"""The one-shot GPU check (``bash benchmarks/gpu_check.sh [--dry-run]``): every section of
``gpu_check_plan`` in priority order, each in its own process group with its own time slice, within
TOTAL_S seconds.

Outputs, in $OUT (else benchmarks/results/<date>-<gpu>/):
  sections.json     one record per section (name, status ok/failed/timeout/skipped, seconds, rc, log,
                    reason, and the section's own fields), rewritten after every section
  summary.md        the section table and the headline ratios side by side, rewritten likewise
  commit.txt        commit, date, host, versions, GPU
  golden_digests.json  this backend's golden digests entry (merge with ``python -m benchmarks.golden_digests --merge``)
  details/          each section's log (<section>.log) and outputs (<section>/: results.json, RESULTS.md ...)
  details.tar.gz    details/ in one file, rewritten after every section

Environment: OUT, DETAILS_DIR (the details folder: default a temporary folder when OUT is set, so that
$OUT holds five files, within what a lent GPU machine hands back; else the output folder's details/), TOTAL_S (default 450; dry
run 600), ONLY (comma list of section names), SLICES ("name=seconds,..."), EXTRA_PRESETS (default
"qwen3:qwen3-8b llama:llama-3.1-8b", dry run "qwen3:qwen3-8b"; empty for none), BENCH_COMMIT (the
commit where .git is absent).
Exit status: 0 when no section failed or timed out (the dry run: when every section is ok, or
skipped because it cannot apply on CPU), 1 otherwise, 2 for bad settings, 143 when stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .gpu_check_plan import DEFAULT_EXTRA_PRESETS, DRY_RUN_EXTRA_PRESETS, RATIOS, plan
from .gpu_check_runner import Stopped, run_sections, write_json_atomic  # noqa: F401  (write_json_atomic: tests)
from .gpu_check_summary import markdown

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE = """import platform, torch, triton, transformers
print(f"python: {platform.python_version()}\\ntorch: {torch.__version__}\\ntriton: {triton.__version__}\\n"
      f"transformers: {transformers.__version__}\\ncuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"gpu: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}, "
          f"{torch.cuda.device_count()} device(s), cuda {torch.version.cuda}")
"""


def _run(argv, timeout=60, **kw) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
        return (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({' '.join(argv[:2])}: {type(exc).__name__}: {exc})"


def commit() -> str:
    head = _run(["git", "rev-parse", "HEAD"], cwd=ROOT)
    if len(head) != 40:
        return os.environ.get("BENCH_COMMIT", "unknown")
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT)
    return head + ("-dirty" if dirty else "")


def provenance(env: dict) -> str:
    versions = _run([sys.executable, "-c", PROVENANCE], env=env)
    return (f"commit: {commit()}\ndate: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\nhost: {platform.node()}\n"
            f"{versions}\n")


def gpu_name() -> str:
    name = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], timeout=30).splitlines()
    name = name[0] if name and not name[0].startswith("(") else ""
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in name)


def parse_slices(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, seconds = item.partition("=")
        out[name.strip()] = float(seconds)
    return out


def write_tarball(details: Path, dest: Path) -> None:
    tmp = dest / ".details.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(details, arcname="details")
    os.replace(tmp, dest / "details.tar.gz")


def passed(records: list[dict], dry_run: bool) -> bool:
    if dry_run:
        return all(r["status"] == "ok" or (r["status"] == "skipped" and r.get("not_applicable")) for r in records)
    return not any(r["status"] in ("failed", "timeout") for r in records)


def main(argv=None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(prog="bash benchmarks/gpu_check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = parser.parse_args(argv)
    try:
        total_s = float(os.environ.get("TOTAL_S") or (600 if args.dry_run else 450))
        slices = parse_slices(os.environ.get("SLICES", ""))
    except ValueError as exc:
        parser.error(f"TOTAL_S or SLICES: {exc}")
    gpu = "" if args.dry_run else gpu_name()
    dest = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" /
                f"{time.strftime('%Y%m%d-%H%M%S')}-{'cpu-dry-run' if args.dry_run else gpu or 'gpu'}").resolve()
    # A lent machine hands back a few files of $OUT: there the details travel as details.tar.gz alone.
    details = Path(os.environ.get("DETAILS_DIR") or (tempfile.mkdtemp(prefix="gpu-check-details-")
                                                     if os.environ.get("OUT") else dest / "details")).resolve()
    details.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    os.environ.update(env)  # the sections inherit it
    extra = os.environ.get("EXTRA_PRESETS", DRY_RUN_EXTRA_PRESETS if args.dry_run else DEFAULT_EXTRA_PRESETS)
    sections = plan(dest, details, args.dry_run, extra_presets=extra, slices=slices)
    only = [s.strip() for s in os.environ.get("ONLY", "").split(",") if s.strip()]
    unknown = sorted(set(only) - {s.name for s in sections}) + sorted(set(slices) - {s.name for s in sections})
    if unknown:
        parser.error(f"ONLY or SLICES name unknown sections {unknown}; sections: {', '.join(s.name for s in sections)}")
    if only:
        sections = [s for s in sections if s.name in only]
    print(f"[gpu_check] writing to {dest} (details: {details}); TOTAL_S={total_s:.0f}", flush=True)
    prov = provenance(env)
    (dest / "commit.txt").write_text(prov)
    (details / "nvidia-smi.txt").write_text(_run(["nvidia-smi"], timeout=30) + "\n")
    print(prov, flush=True)
    where = f"{details.relative_to(dest)}/" if details.is_relative_to(dest) else str(details)
    header = [f"{'Dry run (CPU, Triton interpreter: timings NOT meaningful)' if args.dry_run else 'GPU run'}; "
              f"TOTAL_S={total_s:.0f}; logs and outputs in `{where}` (and details.tar.gz).", "",
              "```", prov.strip(), "```"]
    ratio_names = [name for name, _ in RATIOS]

    def summary_of(results: dict) -> str:  # imported here: it imports torch, which the runner need not
        from .report_summary import summary
        return summary(results)

    def update(records):
        try:
            (dest / "summary.md").write_text(markdown(records, details, header, ratio_names, summary_of))
            write_json_atomic(details / "sections.json", records)
            write_tarball(details, dest)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the sections go on; sections.json stands
            print(f"[gpu_check] summary or details.tar.gz not written: {type(exc).__name__}: {exc}", flush=True)

    stopped = False
    try:
        records = run_sections(sections, dest, details, total_s - (time.monotonic() - started), ROOT, update)
    except Stopped as exc:
        print(f"[gpu_check] stopped by {exc}", flush=True)
        stopped = True
        try:
            records = json.loads((dest / "sections.json").read_text())
        except (OSError, ValueError):  # stopped before the first record was written
            records = []
    update(records)
    text = (dest / "summary.md").read_text()
    print(text)
    elapsed = time.monotonic() - started
    ok = passed(records, args.dry_run)
    print(f"[gpu_check] {'passed' if ok else 'FAILED'} in {elapsed:.0f} s; {dest}", flush=True)
    return 143 if stopped else 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
