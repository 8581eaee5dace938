"""One benchmark section for the GPU check, in its own process: ``python -m benchmarks`` on that
section alone, then its outcome as the runner's exit status.

    python -m benchmarks.gpu_check_bench SECTION --out DIR --budget-s S [--items headline|rest|all]
                                         [--quick] [--model-preset FAMILY:PRESET]

Exit status: 0 when it measured rows and no item raised; ``NOT_APPLICABLE`` (77) when it cannot
apply here (tensor parallelism with fewer than two GPUs; every item failed for want of an optional
package, e.g. peft, fastapi), with the reason; ``OUT_OF_TIME`` (124) when the budget ended before any
item ran; 1 when an item raised (``reason``: the first), the schema check failed, or
tensor parallelism gave another result than TP 1 bitwise. Record: ``rows``, ``failed_items``,
``items_out_of_time`` (and ``reason`` unless it passed); results.json and RESULTS.md go to DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .gpu_check_runner import NOT_APPLICABLE, OUT_OF_TIME
from .gpu_check_tests import ROOT, is_local

TIME_BUDGET = "time budget"
NOT_FAILURES = ("skipped: would need", "needs ")  # memory estimates and device counts: planned skips
META_LISTS = ("sections", "skipped", "plots")


def row_count(results: dict) -> int:
    return sum(len(v) for k, v in results.items() if k not in META_LISTS and isinstance(v, list))


def outcome(results: dict, rc: int) -> tuple[int, dict]:
    """(exit status, record fields) of one section's results.json and ``python -m benchmarks``' status."""
    skipped = results.get("skipped") or []
    failures = [s for s in skipped
                if s.get("reason") != TIME_BUDGET and not str(s.get("reason")).startswith(NOT_FAILURES)]
    fields = {"rows": row_count(results), "failed_items": len(failures),
              "items_out_of_time": sum(s.get("reason") == TIME_BUDGET for s in skipped)}
    missing = {s.get("missing_module") for s in failures}
    if failures and None not in missing and not any(is_local(m, ROOT, ROOT / "tests") for m in missing) \
            and fields["rows"] == 0:
        return NOT_APPLICABLE, {**fields, "reason": f"needs {', '.join(sorted(missing))} (not installed)"}
    if failures:
        return 1, {**fields, "reason": f"{len(failures)} item(s) raised; first: {failures[0]['item']}: "
                                       f"{failures[0]['reason']}"[:300]}
    if rc != 0:
        return 1, {**fields, "reason": f"python -m benchmarks exited {rc} (see the log)"}
    if fields["rows"] == 0 and fields["items_out_of_time"]:
        return OUT_OF_TIME, {**fields, "reason": "the time budget ended before any item ran"}
    bad_tp = [r["tp"] for r in results.get("tp_steps") or [] if not r.get("bitwise_equal_to_tp1")]
    if bad_tp:
        return 1, {**fields, "reason": f"tensor parallelism: TP {bad_tp} not bitwise equal to TP 1"}
    return 0, fields


def gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_bench", description=__doc__.split("\n")[0])
    parser.add_argument("section")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--margin-s", type=float, default=0.0, help="kept from the section's time for the report")
    parser.add_argument("--items", default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-preset", default=None)
    args = parser.parse_args(argv)
    record_path = os.environ.get("GPU_CHECK_RECORD")
    timeout_s = os.environ.get("GPU_CHECK_TIMEOUT_S")  # a slice cut short: stop items in time to write rows
    if timeout_s:
        args.budget_s = max(5.0, min(args.budget_s, float(timeout_s) - args.margin_s))

    def finish(status: int, fields: dict) -> int:
        if record_path:
            Path(record_path).write_text(json.dumps(fields) + "\n")
        print(f"[gpu_check_bench] {args.section}: exit {status} {fields}", flush=True)
        return status

    if args.section == "tensor_parallel" and gpus() < 2:
        return finish(NOT_APPLICABLE, {"reason": f"tensor parallelism needs two or more GPUs (found {gpus()})"})
    from .__main__ import main as bench_main
    bench_argv = ["--only", args.section, "--out", str(args.out), "--budget-s", str(args.budget_s), "--no-plots",
                  "--items", args.items, *(["--quick"] if args.quick else []),
                  *(["--model-preset", args.model_preset] if args.model_preset else [])]
    rc = bench_main(bench_argv)
    try:
        results = json.loads((args.out / "results.json").read_text())
    except (OSError, ValueError) as exc:
        return finish(1, {"reason": f"no results.json: {exc}"})
    status, fields = outcome(results, rc)
    return finish(status, fields)


if __name__ == "__main__":
    sys.exit(main())
