"""python -m benchmarks.fuzz --batchings N: random batch compositions, every row compared bitwise alone.

Each batching draws a family and a dtype, a batch of 1..8 members from that model's sample pool
(drawn with replacement, so a sample may sit in a batch twice), their order, the padding side,
0..8 extra padding columns, ``input_ids`` or ``inputs_embeds``, and explicit or derived
``position_ids``. The batch runs once through the patched model and every row is compared with
the sample alone (``invariant_infer.testing.drift.batch_drift``, ``torch.equal`` on the real tokens).

Models: each family's ``tiny`` preset (hidden 64) with 1 layer, 2 query heads on 1 KV head and
a 128-token vocabulary (FUZZ_OVERRIDES), written with ``save_pretrained`` and loaded with
``from_pretrained(dtype=...)`` as users load real checkpoints. Every family keeps its features:
qwen2 q/k/v bias, untied head; qwen3 q/k head norms, head_dim 16 != 64 / 2, tied; llama3 RoPE
scaling, attention and MLP biases, tied; mistral no sliding window, untied; the mixture-of-experts
families a sparse block of 8 experts (qwen3_moe top-4 renormalised, head_dim 16; mixtral top-2,
routing weights in fp32; qwen2_moe top-2 not renormalised, with its gated shared expert; glm4_moe
top-2 of sigmoid scores picked with a selection bias from 1 of 2 groups, scaled by 2.5, with its ungated
shared MLP, q/k head norms and RoPE on half of each head; gemma4_text@tiny-moe, Gemma 4's MoE variant,
8 experts top-2 beside the dense MLP), so a batch crowds some experts and leaves others empty. A pool is one
model per (family, dtype) and SAMPLES_PER_POOL samples per family, the same for every dtype
(lengths 1, MAX_LEN, LONG_LEN, then uniform in 1..MAX_LEN); a sample's alone logits are
computed on its first use and cached.

``--formats`` adds quantized checkpoints (``benchmarks.fuzz_quantized``): each family in each format
is one model, ``family:FORMAT``, drawn like a family (bf16 and fp16); without it the models, and so
every draw of a seed, are those of the dense families as before.

Every draw is a pure function of (seed, batching index, families, formats, dtypes, pool options), so
``--replay I`` with the same options runs batching I again. Exit status 1 if any row differs;
with ``--negative-control`` (the linear picks BLOCK_K by M, as batch-size-keyed heuristics do,
the MoE experts' grouped GEMM by its most crowded expert, and quantized layers take a per-tensor
activation scale or, weight-only, a BLOCK_K picked by M),
exit status 1 if NO row differs, i.e. the fuzzer failed to catch a batch-variant path.
``--workers N`` runs the batchings in N processes (worker k takes every N-th index); the
summary is the same as one process's.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy
import torch
import transformers
import triton
from tqdm import tqdm

from invariant_infer.testing.drift import batch_drift
from invariant_infer.model.families import FAMILIES
from invariant_infer.checkpoints.loading import DTYPES

from .fuzz_draws import (LONG_LEN, MAX_BATCH, MAX_EXTRA_PAD, MAX_LEN, PRESET_MODELS, SAMPLES_PER_POOL, Batching,
                         Pools, batch_variant_linear, draw, fuzz_overrides, m_dependent_grouped_linear, m_dependent_linear,
                         pool_lengths)
from .fuzz_parallel import exit_status, outcomes, run_or_stop
from .fuzz_quantized import FORMATS, QUANT_DTYPES, model_names
from .report import git_commit

__all__ = ["Batching", "DTYPES", "draw", "m_dependent_grouped_linear", "m_dependent_linear", "pool_lengths", "main",
           "parse", "run"]


# Text models: the draws are token sequences (vision-language models have their own tests; gemma4's text
# model is gemma4_text's, drawn as that), then the other presets drawn as models of their own.
TEXT_FAMILIES = sorted(name for name, adapter in FAMILIES.items()
                       if adapter.vision is None and not adapter.unpatched_modules) + PRESET_MODELS

def _new_cell() -> dict:
    return {"batchings": 0, "rows": 0, "rows_unequal": 0, "batchings_unequal": 0, "max_abs_diff": 0.0}


def _coverage(batching: Batching, max_len: int) -> list[str]:
    keys = [f"side={batching.side}", "inputs_embeds" if batching.embeds else "input_ids",
            "explicit_positions" if batching.explicit_positions else "derived_positions",
            f"batch={len(batching.members)}", "extra_pad>0" if batching.extra_pad else "extra_pad=0"]
    if len(set(batching.members)) < len(batching.members):
        keys.append("repeated_member")
    if max(batching.lengths) > max_len:
        keys.append("long_member")
    if len(set(batching.lengths)) == 1 and batching.extra_pad == 0:
        keys.append("no_padding")
    return keys


def quiet_libraries(threads: int | None) -> None:
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)


def batchings(args, indices):
    """Runs each batching of ``indices`` and yields its outcome: what ``run`` aggregates. Yields
    ``{"stopped": True}`` and ends when ``--time-limit-s`` has passed."""
    quiet_libraries(args.threads)
    started, cpu_started = time.monotonic(), time.process_time()
    batch_s = 0.0
    with tempfile.TemporaryDirectory(prefix="fuzz-ckpt-") as workdir:
        pools = Pools(args.models, args.seed, args.device, Path(workdir), args.pool_size, args.max_len,
                      args.long_len)
        lengths = pools.lengths()

        def stats() -> dict:
            return {"alone_forwards": pools.alone_forwards, "alone_s": pools.alone_s, "batch_forward_s": batch_s,
                    "cpu_s": time.process_time() - cpu_started}

        with batch_variant_linear() if args.negative_control else contextlib.nullcontext():
            for index in indices:
                if args.time_limit_s is not None and time.monotonic() - started > args.time_limit_s:
                    yield {"stopped": True, "stats": stats()}
                    return
                b = draw(args.seed, index, args.models, args.dtypes, lengths, args.max_batch, args.max_extra_pad)
                model = pools.model(b.family, b.dtype)
                alone = pools.alone_logits(b.family, b.dtype, b.members)
                samples = [pools.samples[b.family][m] for m in b.members]
                t0 = time.perf_counter()
                drift = batch_drift(model, samples, **b.options(), alone=alone)
                batch_s += time.perf_counter() - t0
                yield {"batching": b, "rows": drift.rows, "rows_unequal": drift.rows_unequal,
                       "max_abs_diff": drift.max_abs_diff, "mismatches": drift.mismatches, "stats": stats()}


def run(args) -> dict:
    """The fuzz run ``args`` describes (see ``parse``); returns the JSON summary."""
    quiet_libraries(args.threads if args.workers == 1 else None)
    started, cpu_started = time.monotonic(), time.process_time()
    indices = [args.replay] if args.replay is not None else list(range(args.start, args.start + args.batchings))
    result = {
        "command": " ".join(["python -m benchmarks.fuzz"] + [shlex.quote(a) for a in args.argv]),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(Path(__file__).resolve().parents[1]),
        **versions(),
        "device": device_name(args),
        "negative_control": args.negative_control, "seed": args.seed, "families": args.families,
        **({"formats": args.formats, "models": args.models} if args.formats else {}),
        "dtypes": args.dtypes, "model_overrides": {f: fuzz_overrides(f) for f in args.models},
        "pool_size": args.pool_size, "max_len": args.max_len, "long_len": args.long_len, "max_batch": args.max_batch,
        "max_extra_pad": args.max_extra_pad,
        "members_drawn": "with replacement", "start": indices[0], "batchings_requested": len(indices),
        "time_limit_s": args.time_limit_s, "workers": args.workers,
    }
    table = {f"{f}/{d}": _new_cell() for f in args.models for d in args.dtypes}
    coverage: dict[str, int] = {}
    failures = []
    totals = _new_cell()
    worker_stats = [dict(alone_forwards=0, alone_s=0.0, batch_forward_s=0.0, cpu_s=0.0) for _ in range(args.workers)]
    worker_batchings = [0] * args.workers
    stopped = False

    def summary(done: bool) -> dict:
        elapsed = time.monotonic() - started
        cpu = time.process_time() - cpu_started + (sum(s["cpu_s"] for s in worker_stats) if args.workers > 1 else 0)
        failures.sort(key=lambda f: f["index"])
        return {**result, **{k: totals[k] for k in ("batchings", "rows", "rows_unequal", "batchings_unequal")},
                "max_abs_diff": totals["max_abs_diff"], "elapsed_s": round(elapsed, 1),
                "cpu_s": round(cpu, 1),  # CPU time of this process and its workers
                "alone_forwards": sum(s["alone_forwards"] for s in worker_stats),
                "alone_s": round(sum(s["alone_s"] for s in worker_stats), 1),
                "batch_forward_s": round(sum(s["batch_forward_s"] for s in worker_stats), 1),
                "batchings_per_s": round(totals["batchings"] / elapsed, 3) if elapsed else None,
                "batchings_per_cpu_s": round(totals["batchings"] / cpu, 3) if cpu else None,
                "worker_batchings": worker_batchings,
                "stopped_by_time_limit": stopped, "finished": done, "per_model": table,
                "coverage": dict(sorted(coverage.items())), "failures": failures}

    bar = tqdm(total=len(indices), desc="fuzz" + (" (negative control)" if args.negative_control else ""),
               unit="batching", file=sys.stderr, disable=args.quiet, dynamic_ncols=True)
    stream = outcomes(batchings, args, indices, args.workers)
    try:
        for worker, item in stream:
            worker_stats[worker] = item["stats"]
            if item.get("stopped"):
                stopped = True
                continue
            b = item["batching"]
            if args.replay is not None:
                bar.write(f"replay {b.describe()}", file=sys.stderr)
            worker_batchings[worker] += 1
            for cell in (table[f"{b.family}/{b.dtype}"], totals):
                cell["batchings"] += 1
                cell["rows"] += item["rows"]
                cell["rows_unequal"] += item["rows_unequal"]
                cell["batchings_unequal"] += bool(item["rows_unequal"])
                cell["max_abs_diff"] = max(cell["max_abs_diff"], item["max_abs_diff"])
            for key in _coverage(b, args.max_len):
                coverage[key] = coverage.get(key, 0) + 1
            if item["rows_unequal"]:
                failure = {**asdict(b), "mismatches": [{"row": r, "member": b.members[r], "max_abs_diff": d}
                                                       for r, d in item["mismatches"]],
                           "replay": replay_command(args, b.index)}
                failures.append(failure)
                if not args.negative_control or len(failures) <= 3:
                    bar.write(f"MISMATCH {b.describe()}: rows {[r for r, _ in item['mismatches']]} max |diff| "
                              f"{item['max_abs_diff']:.3g}\n  replay: {failure['replay']}", file=sys.stderr)
            bar.update(1)
            bar.set_postfix(rows=totals["rows"], unequal=totals["rows_unequal"], refresh=False)
            if args.out and totals["batchings"] % args.save_every == 0:
                write_json(summary(False), args.out)
    except BaseException as error:  # Ctrl-C, SIGTERM or a failed worker: keep what was done
        if args.out:
            write_json({**summary(False), "interrupted": f"{type(error).__name__}: {error}"[:2000]}, args.out)
        raise
    finally:
        stream.close()  # stops the workers now, also when this loop raised
        bar.close()
    out = summary(True)
    if args.out:
        write_json(out, args.out)
    return out


def versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
            "numpy": numpy.__version__, "python": platform.python_version()}


def device_name(args) -> str:
    if args.device.startswith("cuda"):
        return torch.cuda.get_device_name(args.device)
    threads = args.threads or torch.get_num_threads()
    return (f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.workers} "
            f"worker process{'es' if args.workers > 1 else ''} x {threads} torch threads)")


def replay_command(args, index: int) -> str:
    parts = ["python -m benchmarks.fuzz", "--seed", str(args.seed), "--families", ",".join(args.families),
             "--dtypes", ",".join(args.dtypes), "--replay", str(index)]
    if args.formats:
        parts[-2:-2] = ["--formats", ",".join(args.formats)]
    for flag, value, default in (("--pool-size", args.pool_size, SAMPLES_PER_POOL),
                                 ("--max-len", args.max_len, MAX_LEN), ("--long-len", args.long_len, LONG_LEN),
                                 ("--max-batch", args.max_batch, MAX_BATCH),
                                 ("--max-extra-pad", args.max_extra_pad, MAX_EXTRA_PAD)):
        if value != default:
            parts += [flag, str(value)]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.negative_control:
        parts.append("--negative-control")
    return " ".join(parts)


def write_json(summary: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(path)  # a killed run leaves the last complete summary


def format_table(summary: dict) -> str:
    lines = ["| model | batchings | rows | rows unequal | batchings unequal | max \\|Δ logit\\| |",
             "|---|---:|---:|---:|---:|---:|"]
    cells = list(summary["per_model"].items()) + [("**all**", {k: summary[k] for k in
                                                   ("batchings", "rows", "rows_unequal", "batchings_unequal",
                                                    "max_abs_diff")})]
    for name, c in cells:
        lines.append(f"| {name} | {c['batchings']} | {c['rows']} | {c['rows_unequal']} | {c['batchings_unequal']} | "
                     f"{c['max_abs_diff']:.3g} |")
    return "\n".join(lines)


def csv_choices(value: str, allowed, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {sorted(allowed)}")
    return items


def parse(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description="Random batch compositions, every "
                                "row compared bitwise with the same sample alone.")
    p.add_argument("--batchings", type=int, default=100, help="how many batchings to draw (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--families", type=lambda v: csv_choices(v, TEXT_FAMILIES, "families"), default=TEXT_FAMILIES,
                   help=f"comma list (default all: {','.join(TEXT_FAMILIES)})")
    p.add_argument("--dtypes", type=lambda v: csv_choices(v, DTYPES, "dtypes"), default=None,
                   help="comma list of bf16,fp16,fp32 (default all; bf16,fp16 with quantized --formats)")
    p.add_argument("--formats", type=lambda v: csv_choices(v, FORMATS, "formats"), default=None,
                   help=f"checkpoint formats, each family in each (models named family:FORMAT; none: the "
                   f"dense family); comma list of {','.join(FORMATS)} (default: dense only, as before)")
    p.add_argument("--device", default="cpu", help="cpu (default; kernels in the Triton interpreter) or cuda")
    p.add_argument("--out", type=Path, default=None, help="JSON summary, rewritten every --save-every batchings")
    p.add_argument("--negative-control", action="store_true",
                   help="same batchings with a linear that picks BLOCK_K by M: must report mismatches")
    p.add_argument("--replay", type=int, default=None, metavar="I", help="run batching I only (same other options)")
    p.add_argument("--start", type=int, default=0, help="first batching index (default 0)")
    p.add_argument("--time-limit-s", type=float, default=None, help="start no batching after this many seconds")
    p.add_argument("--pool-size", type=int, default=SAMPLES_PER_POOL, help="samples per family")
    p.add_argument("--max-len", type=int, default=MAX_LEN, help="longest sample")
    p.add_argument("--long-len", type=int, default=LONG_LEN, help="one longer sample per pool (0: none)")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH)
    p.add_argument("--max-extra-pad", type=int, default=MAX_EXTRA_PAD)
    p.add_argument("--workers", type=int, default=1, help="worker processes, each taking every N-th batching "
                   "(default 1: this process); the summary is the same for any N")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads per process (default: torch's, or cores / workers with --workers)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.batchings < 1 or args.pool_size < 1 or args.max_len < 1 or args.max_batch < 1 or args.max_extra_pad < 0:
        p.error("--batchings, --pool-size, --max-len and --max-batch must be >= 1, --max-extra-pad >= 0")
    if args.workers < 1 or (args.replay is not None and args.workers != 1):
        p.error("--workers must be >= 1, and 1 with --replay")
    if args.workers > 1 and args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    quantized = [f for f in args.formats or () if f != "none"]
    if args.dtypes is None:
        args.dtypes = list(QUANT_DTYPES) if quantized else list(DTYPES)
    elif quantized and "fp32" in args.dtypes:
        p.error(f"--formats {','.join(quantized)}: quantized checkpoints run in bf16 or fp16, not fp32; "
                "pass --dtypes bf16,fp16")
    args.models = model_names(args.families, args.formats) if args.formats else list(args.families)
    if not args.models:
        p.error(f"--formats {','.join(args.formats)}: no model; the compressed-tensors formats apply to the dense families")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    args.argv = argv
    return args


def main(argv=None) -> int:
    args = parse(argv)
    summary = run_or_stop("fuzz", run, args, partial_out=args.out)
    if isinstance(summary, int):
        return summary
    print(format_table(summary))
    print(f"[fuzz] {summary['batchings']} batchings, {summary['rows']} rows, {summary['rows_unequal']} unequal "
          f"in {summary['elapsed_s']:.0f} s ({summary['batchings_per_s']} batchings/s; "
          f"{summary['alone_forwards']} alone forwards took {summary['alone_s']:.0f} s)"
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return exit_status("fuzz", summary, unequal="rows_unequal", unit="rows", groups="batchings",
                       what="the sample alone", negative_control=args.negative_control)


if __name__ == "__main__":
    sys.exit(main())
