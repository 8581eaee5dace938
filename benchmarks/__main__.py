"""python -m benchmarks [--quick] [--out DIR] [--only matmul,e2e,...] [--budget-s S]"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

from . import SECTIONS
from .report import metadata, summary, validate, write_all
from .timing import Run, free_memory

# Share of the time budget per section; time one section leaves unused passes to the next.
SHARES = {"matmul": 0.27, "norm_attention": 0.14, "e2e": 0.27, "scoring": 0.1, "divergence": 0.22}


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description="Stock vs invariant: cost and divergence.")
    p.add_argument("--quick", action="store_true", help="tiny shapes on CPU through the Triton interpreter (CI smoke)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default bench_out/<date>-<device>)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new items after this many seconds")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available and not --quick)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    if device.type == "cpu" and not args.quick:
        print("warning: the full suite on CPU runs real Qwen2.5-1.5B shapes through the Triton interpreter "
              "(hours); use --quick", file=sys.stderr)
    t0 = time.monotonic()
    end = t0 + args.budget_s if args.budget_s else None
    ctx = Run(device=device, quick=args.quick)
    results = metadata(device, args.quick)
    results.update({"budget_s": args.budget_s, "sections": args.only,
                    "matmul": [], "rmsnorm": [], "attention": [], "decode_attention": [], "e2e": [], "decode": [],
                    "scoring_memory": [], "scoring_throughput": [], "divergence": []})
    out = args.out or Path("bench_out") / f"{time.strftime('%Y%m%d-%H%M%S')}-{results['device'].split(' (')[0].replace(' ', '-')}"
    for i, name in enumerate(args.only):
        if end is not None:  # this section's share of what is left
            left = [s for s in args.only[i:]]
            share = SHARES[name] / sum(SHARES[s] for s in left)
            ctx.deadline = time.monotonic() + share * max(0.0, end - time.monotonic())
        ctx.section = name
        started = time.monotonic()
        try:
            section = importlib.import_module(f"{__package__}.{name}")
            results.update(section.run(ctx))
        except Exception as exc:  # keep the other sections' numbers
            ctx.failed(f"section {name}", exc)
        free_memory(device)
        print(f"[benchmarks] {name}: {time.monotonic() - started:.1f} s", file=sys.stderr)
        results["skipped"] = ctx.skipped
        write_all(dict(results), out, plots=False)  # partial results survive a hard kill
    results["skipped"] = ctx.skipped
    results["duration_s"] = time.monotonic() - t0
    write_all(results, out, plots=not args.no_plots)
    print(summary(results))
    print(f"[benchmarks] wrote {out}/results.json, RESULTS.md{', plots' if results.get('plots') else ''} "
          f"in {results['duration_s']:.0f} s", file=sys.stderr)
    missing = validate(results)
    if missing:
        print(f"[benchmarks] schema fields missing: {missing[:10]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
