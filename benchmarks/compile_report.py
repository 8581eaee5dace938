"""Registers, spills and shared memory of every kernel variant the supported families reach, per GPU
architecture, compiled offline (no GPU needed): the table in docs/benchmarks.md ("Compiled kernels").

The variants are those the offline compile gate (tests/kernels/test_compile_gate.py) compiles: recorded
from each workload of ``invariant_infer.testing.kernel_variants`` with the CUDA tiles, each compiled by
``invariant_infer.kernels.offline_compile`` with the launches' pinned options. Registers and spills come
from ptxas's own log, shared memory from the compiled kernel's metadata.

    python -m benchmarks.compile_report                      # print the table (about 5 minutes on 2 cores)
    python -m benchmarks.compile_report --write-doc          # and replace the table in docs/benchmarks.md
    python -m benchmarks.compile_report --workloads gpt-oss-20b --archs 90   # a part of it

Exit status 1 when a variant does not compile or needs more shared memory than its architecture has
(each one is listed under the table).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton

from .doc_sections import DOC, replace_section

BEGIN, END = "<!-- compile-report:begin -->", "<!-- compile-report:end -->"


def _cell(report) -> str:
    if report is None:  # not compiled: the launcher refuses fp8 on that architecture
        return "refused (no fp8)"
    if report.error:
        return "does not compile"
    spills = f"{report.spill_stores}/{report.spill_loads}" if report.spill_stores or report.spill_loads else "0"
    over = " **over**" if report.problem else ""
    return f"{report.registers} · {spills} · {report.shared / 1024:.1f}{over}"


def markdown(variants: dict, reports: list, archs) -> str:
    """The table: one row per variant (kernel, constexprs, pointer dtypes, launch options), the
    workloads that reach it, and per arch registers · spill stores/loads (bytes per thread) · shared KiB."""
    by_key = {(report.variant, report.arch): report for report in reports}
    archs = sorted(archs, reverse=True)
    lines = [f"Triton {triton.__version__}, `python -m benchmarks.compile_report --write-doc`. Per architecture: "
             "registers per thread · spill stores/loads (bytes per thread) · shared memory per block (KiB); "
             "**over**: above the architecture's limit (sm_80 163 KiB, sm_89 99 KiB, sm_90 227 KiB).", "",
             "| variant | reached by | " + " | ".join(f"sm_{arch}" for arch in archs) + " |",
             "|---|---|" + "---|" * len(archs)]
    for variant in sorted(variants, key=lambda v: (v.name, v.label())):
        label = variant.label().replace("|", "/")
        lines.append(f"| `{label}` | {', '.join(variants[variant])} | "
                     + " | ".join(_cell(by_key.get((variant, arch))) for arch in archs) + " |")
    problems = [report.problem for report in reports if report.problem]
    if problems:
        lines += ["", f"Variants a GPU of that architecture cannot launch ({len(problems)}):", ""]
        lines += [f"- {' '.join(problem.split())[:400]}" for problem in problems]
    return "\n".join(lines) + "\n"


def write_doc(table: str, doc: Path = DOC) -> None:
    replace_section(table, BEGIN, END, doc)


def main(argv=None) -> int:
    from invariant_infer.kernels.fp8_support import fp8_supported
    from invariant_infer.kernels.offline_compile import ARCHS, compile_reports
    from invariant_infer.testing.kernel_variants import WORKLOADS, record_variants

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", help=f"comma-separated, of: {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--archs", default=",".join(map(str, ARCHS)), help="comma-separated sm numbers")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: the CPU count)")
    parser.add_argument("--write-doc", action="store_true", help=f"replace the table in {DOC.name}")
    args = parser.parse_args(argv)
    archs = [int(arch) for arch in args.archs.split(",")]
    variants = record_variants(args.workloads.split(",") if args.workloads else None)
    print(f"{len(variants)} variants recorded; compiling for {', '.join(f'sm_{a}' for a in archs)}", file=sys.stderr)
    # fp8 variants only where their launchers run them (kernels.fp8_support), as the compile gate does
    fp8 = [variant for variant in variants if any(kind == "*fp8e4nv" for _, kind in variant.signature)]
    reports = (compile_reports([variant for variant in variants if variant not in fp8], archs, workers=args.workers)
               + compile_reports(fp8, [arch for arch in archs if fp8_supported(divmod(arch, 10))],
                                 workers=args.workers))
    table = markdown(variants, reports, archs)
    print(table)
    if args.write_doc:
        write_doc(table)
    return 1 if any(report.problem for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
