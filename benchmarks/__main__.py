"""python -m benchmarks [--quick] [--out DIR] [--only matmul,e2e,...] [--budget-s S] [--model-preset FAMILY:PRESET]
[--items all|headline|rest]; python -m benchmarks plan [--write-doc] [--gpu h100|h200] (benchmarks.plan);
python -m benchmarks kv [--write-doc] (benchmarks.kv); python -m benchmarks embed [options] (= --only embed)"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

from invariant_infer.model.families import FAMILIES

from . import SECTIONS
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .report import summary, write_all
from .schema import metadata, validate
from .timing import ITEMS, Run, free_memory

# Share of the time budget per section; time one section leaves unused passes to the next.
SHARES = {"matmul": 0.23, "norm_attention": 0.12, "e2e": 0.23, "scoring": 0.09, "divergence": 0.18, "engine": 0.14,
          "host_overhead": 0.05, "server": 0.11, "train": 0.1, "moe": 0.1, "gdn": 0.06, "tensor_parallel": 0.08,
          "spec": 0.08, "quant": 0.06, "lora": 0.08, "vlm": 0.06, "embed": 0.06}
DEFAULT_MODEL_PRESET = f"{DEFAULT_FAMILY}:{DEFAULT_PRESET}"
# The sections with headline items (--items headline); with --items rest the others run every item.
HEADLINE_SECTIONS = ("matmul", "norm_attention", "e2e", "engine", "quant")


# The sections run text models (vision-language models have their own tests).
TEXT_FAMILIES = {name: adapter for name, adapter in sorted(FAMILIES.items()) if adapter.vision is None}


def _presets() -> str:
    return "; ".join(f"{family}:{{{','.join(adapter.presets)}}}" for family, adapter in TEXT_FAMILIES.items())


def model_preset(value: str) -> tuple[str, str]:
    """argparse type for --model-preset: "FAMILY:PRESET" -> (family, preset), checked against
    invariant_infer.model.families.FAMILIES and each adapter's presets."""
    family, sep, preset = value.partition(":")
    if not sep or not family or not preset:
        raise argparse.ArgumentTypeError(f"expected FAMILY:PRESET (e.g. llama:llama-3.1-8b), got {value!r}")
    if family not in TEXT_FAMILIES:
        raise argparse.ArgumentTypeError(f"unknown family {family!r}; choose from {', '.join(TEXT_FAMILIES)}")
    if preset not in FAMILIES[family].presets:
        raise argparse.ArgumentTypeError(f"unknown {family} preset {preset!r}; choose from "
                                         f"{', '.join(FAMILIES[family].presets)}")
    return family, preset


def parse(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["embed"]:  # the embedding models' section alone: python -m benchmarks embed [--quick] ...
        argv = ["--only", "embed", *argv[1:]]
    p = argparse.ArgumentParser(prog="python -m benchmarks", description="Stock vs invariant: cost and divergence.")
    p.add_argument("--quick", action="store_true", help="tiny shapes on CPU through the Triton interpreter (CI smoke)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default bench_out/<date>-<device>)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new items after this many seconds")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available and not --quick)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--items", choices=ITEMS, default="all",
                   help="all (default); headline: each section's few headline items (GEMM at M 1/16/64/4096, attention "
                        "prefill and split-KV decode against the stock kernels, FP8 GEMMs, e2e scoring and decode, "
                        "engine throughput; other sections have none); "
                        "rest: the others")
    p.add_argument("--model-preset", type=model_preset, default=DEFAULT_MODEL_PRESET, metavar="FAMILY:PRESET",
                   help=f"the model whose shapes every section uses (default {DEFAULT_MODEL_PRESET}; quick mode "
                        f"scales them down). Choices: {_presets()}")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.items == "headline":  # the others have no headline items
        args.only = [s for s in args.only if s in HEADLINE_SECTIONS]
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # the plan report: python -m benchmarks plan --help
        from .plan import main as plan_main
        return plan_main(argv[1:])
    if argv[:1] == ["kv"]:  # the KV memory report: python -m benchmarks kv --help
        from .kv import main as kv_main
        return kv_main(argv[1:])
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    family, preset = args.model_preset
    if device.type == "cpu" and not args.quick:
        print(f"warning: the full suite on CPU runs real {family}:{preset} shapes through the Triton interpreter "
              "(hours); use --quick", file=sys.stderr)
    t0 = time.monotonic()
    end = t0 + args.budget_s if args.budget_s else None
    ctx = Run(device=device, quick=args.quick, items=args.items)
    results = metadata(device, args.quick, family=family, preset=preset)
    results.update({"budget_s": args.budget_s, "sections": args.only, "items": args.items,
                    "matmul": [], "rmsnorm": [], "attention": [], "decode_attention": [], "e2e": [], "decode": [],
                    "scoring_memory": [], "scoring_throughput": [], "divergence": [], "engine": [],
                    "host_overhead": [], "server": [], "train": [], "moe": [], "gdn": [], "gdn_prefill": [],
                    "gdn_decode": [], "tp_exchange": [], "tp_steps": [], "spec": [], "quant": [], "lora": [],
                    "vlm": [], "attention_vs_stock": [], "embed": [], "embed_divergence": []})
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
            results.update(section.run(ctx, family=family, preset=preset))
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
