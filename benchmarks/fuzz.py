"""python -m benchmarks.fuzz --batchings N: random batch compositions, every row compared bitwise alone.

Each batching draws a family and a dtype, a batch of 1..8 members from that model's sample pool
(drawn with replacement, so a sample may sit in a batch twice), their order, the padding side,
0..8 extra padding columns, ``input_ids`` or ``inputs_embeds``, and explicit or derived
``position_ids``. The batch runs once through the patched model and every row is compared with
the sample alone (``invariant_infer.drift.batch_drift``, ``torch.equal`` on the real tokens).

Models: each family's ``tiny`` preset (hidden 64) with 1 layer, 2 query heads on 1 KV head and
a 128-token vocabulary (FUZZ_OVERRIDES), written with ``save_pretrained`` and loaded with
``from_pretrained(dtype=...)`` as users load real checkpoints. Every family keeps its features:
qwen2 q/k/v bias, untied head; qwen3 q/k head norms, head_dim 16 != 64 / 2, tied; llama3 RoPE
scaling, attention and MLP biases, tied; mistral no sliding window, untied. A pool is one
model per (family, dtype) and SAMPLES_PER_POOL samples per family, the same for every dtype
(lengths 1, MAX_LEN, LONG_LEN, then uniform in 1..MAX_LEN); a sample's alone logits are
computed on its first use and cached.

Every draw is a pure function of (seed, batching index, families, dtypes, pool options), so
``--replay I`` with the same options runs batching I again. Exit status 1 if any row differs;
with ``--negative-control`` (the linear picks BLOCK_K by M, as batch-size-keyed heuristics do),
exit status 1 if NO row differs, i.e. the fuzzer failed to catch a batch-variant path.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Speed: the interpreter pays per kernel launch and per program (attention runs B x heads programs),
# so the fuzz models are each family's "tiny" preset with 1 layer (every kernel still runs and any
# batch dependence reaches the logits), 2 query heads sharing 1 KV head (still GQA) and a 128-token
# vocabulary (one lm_head tile, as with 512): about 2x the batchings/s of 2 layers and 4 heads.
# What makes each family different stays (see the module docstring); qwen3's head_dim 16 keeps
# head_dim != hidden / heads (64 / 2 = 32).
FUZZ_OVERRIDES = dict(num_hidden_layers=1, vocab_size=128, num_attention_heads=2, num_key_value_heads=1)
FAMILY_OVERRIDES = {"qwen3": dict(head_dim=16)}
SAMPLES_PER_POOL = 24
MAX_LEN = 40
# One longer sample per pool: on CPU the attention's KV block is 64 keys and blocks start at a
# row's first real key, so only a sample past 64 tokens runs the online softmax across blocks.
LONG_LEN = 72
MAX_BATCH = 8
MAX_EXTRA_PAD = 8
SMALL_M = 32  # negative control: the linear's BLOCK_K is 16 at M <= SMALL_M rows


@dataclass(frozen=True)
class Batching:
    index: int
    family: str
    dtype: str
    members: tuple[int, ...]  # pool indices, in batch order (repeats allowed)
    lengths: tuple[int, ...]  # real tokens of each member
    side: str                 # "left" or "right" padding
    extra_pad: int            # columns beyond the longest member
    embeds: bool              # inputs_embeds instead of input_ids
    explicit_positions: bool  # position_ids = cumsum(mask) - 1 passed, else derived by the model

    def options(self) -> dict:
        return dict(side=self.side, extra_pad=self.extra_pad, embeds=self.embeds,
                    explicit_positions=self.explicit_positions)

    def describe(self) -> str:
        return (f"#{self.index} {self.family} {self.dtype} B={len(self.members)} members={list(self.members)} "
                f"lengths={list(self.lengths)} side={self.side} extra_pad={self.extra_pad} "
                f"{'inputs_embeds' if self.embeds else 'input_ids'} "
                f"{'explicit' if self.explicit_positions else 'derived'} positions")


def draw(seed: int, index: int, families: list[str], dtypes: list[str], pool_lengths: dict[str, list[int]],
         max_batch: int = MAX_BATCH, max_extra_pad: int = MAX_EXTRA_PAD) -> Batching:
    """Batching ``index`` of the run seeded ``seed``: independent of every other index."""
    rng = random.Random(f"fuzz/{seed}/{index}")
    family = rng.choice(families)
    dtype = rng.choice(dtypes)
    lengths = pool_lengths[family]
    size = rng.randint(1, max_batch)
    members = tuple(rng.randrange(len(lengths)) for _ in range(size))  # with replacement, in drawn order
    return Batching(index=index, family=family, dtype=dtype, members=members,
                    lengths=tuple(lengths[m] for m in members), side=rng.choice(("left", "right")),
                    extra_pad=rng.randint(0, max_extra_pad), embeds=rng.random() < 0.5,
                    explicit_positions=rng.random() < 0.5)


def pool_lengths(seed: int, family: str, size: int = SAMPLES_PER_POOL, max_len: int = MAX_LEN,
                 long_len: int = LONG_LEN) -> list[int]:
    """1, max_len, long_len (if > 0), then uniform in 1..max_len: ``size`` lengths."""
    g = _generator(seed, family)
    fixed = [1, max_len] + ([long_len] if long_len > 0 else [])
    return (fixed + torch.randint(1, max_len + 1, (size,), generator=g).tolist())[:size]


def pool_samples(seed: int, family: str, vocab: int, size: int = SAMPLES_PER_POOL, max_len: int = MAX_LEN,
                 long_len: int = LONG_LEN) -> list[torch.Tensor]:
    """The family's samples (the same for every dtype): token ids uniform in the vocabulary."""
    g = _generator(seed, family)
    g.manual_seed(g.initial_seed() + 1)
    return [torch.randint(0, vocab, (n,), generator=g) for n in pool_lengths(seed, family, size, max_len, long_len)]


def _generator(seed: int, family: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(family.encode()))


def m_dependent_linear(x, weight, bias=None):
    """Negative control: BLOCK_K 16 for at most SMALL_M rows, the shape's own config above, as
    batch-size-keyed heuristics and autotuners do (tests/test_linear.py has the same idea)."""
    from invariant_infer.kernels import linear
    try:
        from invariant_infer.kernels.configs import linear_config
    except ImportError:  # before the configs module
        from invariant_infer.kernels.linear import linear_config

    m = x.reshape(-1, x.shape[-1]).shape[0]
    config = linear_config(x.device.type, x.dtype, *weight.shape)
    if m <= SMALL_M:
        config = replace(config, block_k=16)
    return linear(x, weight, bias, config=config)


@contextlib.contextmanager
def batch_variant_linear():
    """Every patched projection goes through ``m_dependent_linear`` for the block."""
    import invariant_infer.patch as patch

    original = patch.linear
    patch.linear = m_dependent_linear
    try:
        yield
    finally:
        patch.linear = original


def fuzz_overrides(family: str) -> dict:
    return {**FUZZ_OVERRIDES, **FAMILY_OVERRIDES.get(family, {})}


class Pools:
    """One patched model per (family, dtype), loaded on first use; each sample's alone logits cached."""

    def __init__(self, families, seed: int, device: str, workdir: Path, pool_size: int, max_len: int,
                 long_len: int):
        from invariant_infer.random_checkpoints import random_config

        self.seed, self.device, self.workdir = seed, device, workdir
        self.configs = {f: random_config(f, "tiny", **fuzz_overrides(f)) for f in families}
        self.samples = {f: pool_samples(seed, f, c.vocab_size, pool_size, max_len, long_len)
                        for f, c in self.configs.items()}
        self.models: dict[tuple, torch.nn.Module] = {}
        self.alone: dict[tuple, list] = {}
        self.alone_s = 0.0
        self.alone_forwards = 0

    def lengths(self) -> dict[str, list[int]]:
        return {f: [len(s) for s in samples] for f, samples in self.samples.items()}

    def model(self, family: str, dtype: str):
        key = (family, dtype)
        if key not in self.models:
            from transformers import AutoModelForCausalLM

            from invariant_infer import make_invariant
            from invariant_infer.random_checkpoints import save_random_checkpoint

            path = self.workdir / family
            if not path.exists():
                save_random_checkpoint(path, self.configs[family], seed=self.seed)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(self.device).eval()
            self.models[key] = make_invariant(model)
            self.alone[key] = [None] * len(self.samples[family])
        return self.models[key]

    def alone_logits(self, family: str, dtype: str, members) -> list[torch.Tensor]:
        from invariant_infer.drift import logits_alone

        model, cache = self.model(family, dtype), self.alone[(family, dtype)]
        for m in members:
            if cache[m] is None:
                t0 = time.perf_counter()
                logits = logits_alone(model, self.samples[family][m])
                if not torch.isfinite(logits).all():  # NaN != NaN would read as a mismatch
                    raise RuntimeError(f"{family} {dtype}: sample {m} alone has non-finite logits")
                cache[m] = logits
                self.alone_s += time.perf_counter() - t0
                self.alone_forwards += 1
        return [cache[m] for m in members]


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


def run(args) -> dict:
    """The fuzz run ``args`` describes (see ``parse``); returns the JSON summary."""
    from invariant_infer.drift import batch_drift

    import transformers
    import triton

    from .report import git_commit

    device = args.device
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    started, cpu_started = time.monotonic(), time.process_time()
    indices = [args.replay] if args.replay is not None else list(range(args.start, args.start + args.batchings))
    result = {
        "command": " ".join(["python -m benchmarks.fuzz"] + [shlex.quote(a) for a in args.argv]),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(Path(__file__).resolve().parents[1]),
        "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
        "device": (torch.cuda.get_device_name(device) if device.startswith("cuda")
                   else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                        f"{torch.get_num_threads()} torch threads)"),
        "negative_control": args.negative_control, "seed": args.seed, "families": args.families,
        "dtypes": args.dtypes, "model_overrides": {f: fuzz_overrides(f) for f in args.families},
        "pool_size": args.pool_size, "max_len": args.max_len, "long_len": args.long_len, "max_batch": args.max_batch,
        "max_extra_pad": args.max_extra_pad,
        "members_drawn": "with replacement", "batchings_requested": len(indices),
        "time_limit_s": args.time_limit_s,
    }
    table = {f"{f}/{d}": _new_cell() for f in args.families for d in args.dtypes}
    coverage: dict[str, int] = {}
    failures = []
    totals = _new_cell()
    batch_s = 0.0
    stopped = False

    def summary(done: bool) -> dict:
        elapsed, cpu = time.monotonic() - started, time.process_time() - cpu_started
        return {**result, **{k: totals[k] for k in ("batchings", "rows", "rows_unequal", "batchings_unequal")},
                "max_abs_diff": totals["max_abs_diff"], "elapsed_s": round(elapsed, 1),
                "cpu_s": round(cpu, 1),  # this process's CPU time: the wall time less what other processes took
                "alone_forwards": pools.alone_forwards, "alone_s": round(pools.alone_s, 1),
                "batch_forward_s": round(batch_s, 1),
                "batchings_per_s": round(totals["batchings"] / elapsed, 3) if elapsed else None,
                "batchings_per_cpu_s": round(totals["batchings"] / cpu, 3) if cpu else None,
                "stopped_by_time_limit": stopped, "finished": done, "per_model": table,
                "coverage": dict(sorted(coverage.items())), "failures": failures}

    with tempfile.TemporaryDirectory(prefix="fuzz-ckpt-") as workdir:
        pools = Pools(args.families, args.seed, device, Path(workdir), args.pool_size, args.max_len,
                      args.long_len)
        lengths = pools.lengths()
        variant = batch_variant_linear() if args.negative_control else contextlib.nullcontext()
        bar = tqdm(indices, desc="fuzz" + (" (negative control)" if args.negative_control else ""),
                   unit="batching", file=sys.stderr, disable=args.quiet, dynamic_ncols=True)
        with variant:
            for n, index in enumerate(bar):
                if args.time_limit_s is not None and time.monotonic() - started > args.time_limit_s:
                    stopped = True
                    break
                b = draw(args.seed, index, args.families, args.dtypes, lengths, args.max_batch, args.max_extra_pad)
                if args.replay is not None:
                    bar.write(f"replay {b.describe()}", file=sys.stderr)
                model = pools.model(b.family, b.dtype)
                alone = pools.alone_logits(b.family, b.dtype, b.members)
                samples = [pools.samples[b.family][m] for m in b.members]
                t0 = time.perf_counter()
                drift = batch_drift(model, samples, **b.options(), alone=alone)
                batch_s += time.perf_counter() - t0
                for cell in (table[f"{b.family}/{b.dtype}"], totals):
                    cell["batchings"] += 1
                    cell["rows"] += drift.rows
                    cell["rows_unequal"] += drift.rows_unequal
                    cell["batchings_unequal"] += bool(drift.rows_unequal)
                    cell["max_abs_diff"] = max(cell["max_abs_diff"], drift.max_abs_diff)
                for key in _coverage(b, args.max_len):
                    coverage[key] = coverage.get(key, 0) + 1
                if drift.rows_unequal:
                    failure = {**asdict(b), "mismatches": [{"row": r, "member": b.members[r], "max_abs_diff": d}
                                                           for r, d in drift.mismatches],
                               "replay": replay_command(args, index)}
                    failures.append(failure)
                    if not args.negative_control or len(failures) <= 3:
                        bar.write(f"MISMATCH {b.describe()}: rows {[r for r, _ in drift.mismatches]} max |diff| "
                                  f"{drift.max_abs_diff:.3g}\n  replay: {failure['replay']}", file=sys.stderr)
                bar.set_postfix(rows=totals["rows"], unequal=totals["rows_unequal"], refresh=False)
                if args.out and (n + 1) % args.save_every == 0:
                    write_json(summary(False), args.out)
        bar.close()
        out = summary(True)
    if args.out:
        write_json(out, args.out)
    return out


def replay_command(args, index: int) -> str:
    parts = ["python -m benchmarks.fuzz", "--seed", str(args.seed), "--families", ",".join(args.families),
             "--dtypes", ",".join(args.dtypes), "--replay", str(index)]
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


def _csv(value: str, allowed, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {sorted(allowed)}")
    return items


def parse(argv=None):
    from invariant_infer.families import FAMILIES

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description="Random batch compositions, every "
                                "row compared bitwise with the same sample alone.")
    p.add_argument("--batchings", type=int, default=100, help="how many batchings to draw (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--families", type=lambda v: _csv(v, FAMILIES, "families"), default=sorted(FAMILIES),
                   help=f"comma list (default all: {','.join(sorted(FAMILIES))})")
    p.add_argument("--dtypes", type=lambda v: _csv(v, DTYPES, "dtypes"), default=list(DTYPES),
                   help="comma list of bf16,fp16,fp32 (default all)")
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
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.batchings < 1 or args.pool_size < 1 or args.max_len < 1 or args.max_batch < 1 or args.max_extra_pad < 0:
        p.error("--batchings, --pool-size, --max-len and --max-batch must be >= 1, --max-extra-pad >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    args.argv = argv
    return args


def main(argv=None) -> int:
    args = parse(argv)
    summary = run(args)
    print(format_table(summary))
    print(f"[fuzz] {summary['batchings']} batchings, {summary['rows']} rows, {summary['rows_unequal']} unequal "
          f"in {summary['elapsed_s']:.0f} s ({summary['batchings_per_s']} batchings/s; "
          f"{summary['alone_forwards']} alone forwards took {summary['alone_s']:.0f} s)"
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    if args.negative_control:
        if summary["rows_unequal"] == 0:
            print("[fuzz] NEGATIVE CONTROL FAILED: the batch-variant linear went undetected", file=sys.stderr)
            return 1
        print(f"[fuzz] negative control caught the batch-variant linear in {summary['batchings_unequal']} of "
              f"{summary['batchings']} batchings", file=sys.stderr)
        return 0
    if summary["rows_unequal"]:
        print(f"[fuzz] FAILED: {summary['rows_unequal']} rows differ from the sample alone; first: "
              f"{summary['failures'][0]['replay']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
