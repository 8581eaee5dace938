"""results.json, RESULTS.md and PNG plots; ``python -m benchmarks.report --summary results.json``
prints the short summary table. The markdown is ``report_markdown``'s, the summary ``report_summary``'s."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .plots import make_plots
from .report_markdown import decorate, fmt, markdown, table  # noqa: F401  (fmt, table: importable from here)
from .report_summary import summary
from .schema import git_commit, validate  # noqa: F401  (git_commit: benchmarks.fuzz)


def _strip(results: dict) -> dict:
    return {k: ([{kk: vv for kk, vv in r.items() if not kk.startswith("_")} for r in v]
                if isinstance(v, list) and v and isinstance(v[0], dict) else v) for k, v in results.items()}


def write_all(results: dict, out: Path, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        results["plots"] = make_plots(results, out)
    clean = _strip(results)
    (out / "results.json").write_text(json.dumps(clean, indent=1, default=str) + "\n")
    decorate(results)
    (out / "RESULTS.md").write_text(markdown(results))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--summary", metavar="RESULTS_JSON", required=True)
    args = parser.parse_args(argv)
    results = json.loads(Path(args.summary).read_text())
    print(summary(results))
    missing = validate(results)
    if missing:
        print(f"schema: missing {missing[:10]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
