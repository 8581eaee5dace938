"""python -m benchmarks.fuzz_engine --schedules N: random engine schedules, every request compared
bitwise with the same request alone in a fresh engine.

Each schedule draws a family and a dtype, engine options (``max_num_seqs``, ``max_num_batched_tokens``,
a KV cache of only a few pages beyond what the largest request needs, so that sequences get
preempted and recomputed, prefix caching on or off) and 2..MAX_REQUESTS requests: a prompt (half
of the schedules share a prefix longer than one KV page among some of their prompts, so later
arrivals hit the prefix cache), its arrival step (requests are added between steps), max_tokens,
greedy or seeded sampling (temperature, top-k, top-p, repetition penalty), logprobs and prompt
logprobs, stop tokens, ignore_eos. Half of the schedules speculate (n-gram prompt lookup, or the model
itself as its draft, 1..MAX_SPECULATIVE proposals a step; some requests opt out), on the models that
support it (not Gemma 4's). The schedule runs
through one engine; then each request runs alone through a fresh engine that does not speculate,
and its token ids, logprobs, top logprobs, prompt logprobs, seed and
finish reason must be equal (``==`` on the Python floats the engine returns).

Models: those of ``benchmarks.fuzz`` (each family's tiny preset, 1 layer, 128-token vocabulary; Gemma 4's
MoE variant, ``gemma4_text@tiny-moe``).
Every draw is a pure function of (seed, index, families, dtypes, device), so ``--replay I`` runs
schedule I again; ``--workers N`` splits the schedules by index over N processes; exit status 1
on any mismatch; with ``--negative-control`` (the linear picks BLOCK_K by M) exit status 1 if NO
request differs.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.engine.kv_cache_layout import kv_cache_layout
from invariant_infer.engine.model_runner import ModelRunner
from invariant_infer.model.families import FAMILIES
from invariant_infer.model.kinds import config_kinds
from invariant_infer.model.support import supports
from invariant_infer.checkpoints.loading import DTYPES

from .fuzz import csv_choices, device_name, quiet_libraries, versions, write_json
from .fuzz_draws import PRESET_MODELS, Models, batch_variant_linear, fuzz_config, fuzz_overrides
from .fuzz_parallel import exit_status, outcomes, run_or_stop
from .report import git_commit

MAX_REQUESTS = 6
MAX_PROMPT = 40
MAX_NEW_TOKENS = 6
MAX_ARRIVAL = 8          # requests arrive before engine steps 0..MAX_ARRIVAL
MAX_EXTRA_PAGES = 2      # KV pages beyond the largest request's: few, so sequences get preempted
MAX_SPECULATIVE = 8      # proposals per verify step
MAX_STEPS = 2000         # a schedule that takes more steps has stopped making progress
COMPARED = ("token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "prompt_greedy",
            "seed", "finish_reason", "error")


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    arrival: int
    params: tuple[tuple[str, object], ...]  # SamplingParams fields (a tuple: the draw stays hashable)

    def sampling(self) -> SamplingParams:
        return SamplingParams(**{k: list(v) if isinstance(v, tuple) else v for k, v in self.params})


@dataclass(frozen=True)
class Schedule:
    index: int
    family: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    extra_pages: int
    enable_prefix_caching: bool
    shared_prefix: int  # tokens of the prefix some prompts share (0: none)
    requests: tuple[Request, ...]
    speculative: tuple[tuple[str, object], ...] = ()  # Engine(speculative=dict(...)) (a draft model: itself)

    def describe(self) -> str:
        return (f"#{self.index} {self.family} {self.dtype} {len(self.requests)} requests, prompts "
                f"{[len(r.prompt) for r in self.requests]} arriving at {[r.arrival for r in self.requests]}, "
                f"max_num_seqs={self.max_num_seqs} max_num_batched_tokens={self.max_num_batched_tokens} "
                f"extra_pages={self.extra_pages} prefix_caching={self.enable_prefix_caching} "
                f"shared_prefix={self.shared_prefix} speculative={dict(self.speculative) or None}")


def draw_params(rng: random.Random, vocab: int) -> tuple:
    params = {"max_tokens": rng.randint(1, MAX_NEW_TOKENS), "seed": rng.randrange(2 ** 32),
              "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:  # seeded sampling; else greedy
        params.update(temperature=rng.choice((0.5, 0.8, 1.0, 1.5)), top_k=rng.choice((0, 5, 40)),
                      top_p=rng.choice((1.0, 0.9, 0.5)))
    if rng.random() < 0.25:
        params["repetition_penalty"] = 1.3
    if rng.random() < 0.25:
        params["stop_token_ids"] = (rng.randrange(vocab),)
    params["logprobs"] = rng.choice((None, 0, 1, 3))
    params["prompt_logprobs"] = rng.choice((None, None, 0, 2))
    return tuple(sorted(params.items()))


def draw(seed: int, index: int, families: list[str], dtypes: list[str], vocab: dict[str, int],
         page_sizes: dict[tuple[str, str], int]) -> Schedule:
    """Schedule ``index`` of the run seeded ``seed``: independent of every other index."""
    rng = random.Random(f"engine-fuzz/{seed}/{index}")
    family, dtype = rng.choice(families), rng.choice(dtypes)
    v = vocab[family]
    count = rng.randint(2, MAX_REQUESTS)
    shared = page_sizes[family, dtype] + rng.randint(0, 16) if rng.random() < 0.5 else 0
    prefix = [rng.randrange(v) for _ in range(shared)]
    requests = []
    for _ in range(count):
        # Some prompts end just short of a page, so that decoding crosses into a new page, and with
        # a small cache that preempts a later sequence.
        length = page_sizes[family, dtype] - rng.randint(1, MAX_NEW_TOKENS) if rng.random() < 0.4 else \
            rng.randint(1, MAX_PROMPT)
        own = [rng.randrange(v) for _ in range(length)]
        prompt = prefix + own if shared and rng.random() < 0.7 else own
        requests.append(Request(tuple(prompt), rng.randint(0, MAX_ARRIVAL), draw_params(rng, v)))
    budget = rng.choice((rng.randint(1, 8), rng.randint(8, 48), rng.randint(48, 256)))
    schedule = Schedule(index=index, family=family, dtype=dtype, max_num_seqs=rng.randint(1, count),
                        max_num_batched_tokens=budget, extra_pages=rng.choice((0, 0, 1, MAX_EXTRA_PAGES)),
                        enable_prefix_caching=rng.random() < 0.75, shared_prefix=shared, requests=tuple(requests))
    # drawn last: the draws above are those of runs before it; never for a model that refuses speculation (Gemma 4)
    return draw_speculative(rng, schedule) if speculates(family) else schedule


@functools.cache
def speculates(model: str) -> bool:
    return supports(config_kinds(fuzz_config(model)), "speculative")


def draw_speculative(rng: random.Random, s: Schedule) -> Schedule:
    """Half of the schedules speculate, with k + 1 within the token budget; a fifth of their requests
    opt out (SamplingParams.speculative=False)."""
    if rng.random() < 0.5 or s.max_num_batched_tokens < 2:
        return s
    k = rng.randint(1, min(MAX_SPECULATIVE, s.max_num_batched_tokens - 1))
    if rng.random() < 0.5:
        low = rng.randint(1, 2)
        config = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=low,
                      prompt_lookup_max=rng.randint(low, 4))
    else:
        config = dict(method="draft_model", num_speculative_tokens=k)
    requests = tuple(Request(r.prompt, r.arrival, tuple(sorted(r.params + (("speculative", False),))))
                     if rng.random() < 0.2 else r for r in s.requests)
    return replace(s, requests=requests, speculative=tuple(sorted(config.items())))


def draw_context(families, dtypes, device: str) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """What ``draw`` needs of the models: each family's vocabulary and each model's KV page size."""
    configs = {f: fuzz_config(f) for f in families}
    pages = {(f, d): ModelRunner.page_size_for(configs[f], torch.device(device), DTYPES[d])
             for f in families for d in dtypes}
    return {f: c.vocab_size for f, c in configs.items()}, pages


def differences(a, b) -> list[str]:
    """The compared fields in which two RequestOutputs differ."""
    return [name for name in COMPARED if getattr(a, name) != getattr(b, name)]


class Runner:
    """Runs schedules on the fuzz models: all requests in one engine, then each alone."""

    def __init__(self, families, seed: int, device: str, workdir: Path):
        self.models = Models(families, seed, device, workdir)
        self.device = device
        self.alone_s = 0.0

    def _pages(self, family: str, dtype: str, requests) -> tuple[int, int]:
        config = self.models.configs[family]
        page_size = ModelRunner.page_size_for(config, torch.device(self.device), DTYPES[dtype])
        layout = kv_cache_layout(config)  # a page holds one KV cache group's layers: a request needs pages in each
        need = max(-(-(len(r.prompt) + dict(r.params)["max_tokens"]) // page_size) for r in requests)
        need *= len(layout.groups)
        return need, layout.page_bytes(DTYPES[dtype], page_size)

    def together(self, s: Schedule):
        """(outputs in request order, engine) of the whole schedule through one engine."""
        need, page_bytes = self._pages(s.family, s.dtype, s.requests)
        model, speculative = self.models(s.family, s.dtype), dict(s.speculative) or None
        if speculative and speculative["method"] == "draft_model":
            speculative["model"] = model
        engine = Engine(model, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                        kv_cache_memory=(need + s.extra_pages) * page_bytes,
                        enable_prefix_caching=s.enable_prefix_caching, speculative=speculative)
        outputs, ids, step = {}, {}, 0
        while len(outputs) < len(s.requests):
            for i, r in enumerate(s.requests):
                if r.arrival == step:
                    ids[engine.add_request(list(r.prompt), r.sampling())] = i
            for out in engine.step():
                if out.finished:
                    outputs[ids[out.request_id]] = out
            step += 1
            if step > MAX_STEPS:
                raise RuntimeError(f"schedule {s.index}: no progress after {MAX_STEPS} engine steps")
        return [outputs[i] for i in range(len(s.requests))], engine, step

    def alone(self, s: Schedule, r: Request):
        t0 = time.perf_counter()
        need, page_bytes = self._pages(s.family, s.dtype, [r])
        out = Engine(self.models(s.family, s.dtype), kv_cache_memory=need * page_bytes).generate(
            [list(r.prompt)], r.sampling())[0]
        self.alone_s += time.perf_counter() - t0
        return out


def _coverage(s: Schedule, engine) -> list[str]:
    params = [dict(r.params) for r in s.requests]
    keys = [f"requests={len(s.requests)}", f"prefix_caching={'on' if s.enable_prefix_caching else 'off'}"]
    keys += ["sampled" if p.get("temperature") else "greedy" for p in params]
    keys += [f"logprobs={p['logprobs']}" for p in params if p["logprobs"] is not None]
    keys += ["prompt_logprobs" for p in params if p["prompt_logprobs"] is not None]
    if engine.core.scheduler.num_preemptions:
        keys.append("preempted")
    if engine.core.blocks.prefix_hits:
        keys.append("prefix_hit")
    if any(len(r.prompt) > s.max_num_batched_tokens for r in s.requests):
        keys.append("chunked_prefill")
    if engine.core.speculative is not None:
        stats = engine.core.speculative.stats
        keys.append(f"speculative={dict(s.speculative)['method']}")
        keys += ["spec_accepted"] * bool(stats.num_accepted_tokens)
        keys += ["spec_rejected"] * (stats.num_draft_tokens > stats.num_accepted_tokens)
    if len({r.arrival for r in s.requests}) > 1:
        keys.append("staggered_arrivals")
    if s.max_num_seqs < len(s.requests):
        keys.append("seq_cap_below_requests")
    return keys


def schedules(args, indices):
    """Runs each schedule of ``indices`` and yields its outcome: what ``run`` aggregates."""
    quiet_libraries(args.threads)
    started, cpu_started = time.monotonic(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="fuzz-engine-ckpt-") as workdir:
        runner = Runner(args.families, args.seed, args.device, Path(workdir))
        vocab, page_sizes = draw_context(args.families, args.dtypes, args.device)
        with batch_variant_linear() if args.negative_control else contextlib.nullcontext():
            for index in indices:
                if args.time_limit_s is not None and time.monotonic() - started > args.time_limit_s:
                    yield {"stopped": True, "stats": {"alone_s": runner.alone_s,
                                                      "cpu_s": time.process_time() - cpu_started}}
                    return
                s = draw(args.seed, index, args.families, args.dtypes, vocab, page_sizes)
                yield {**check(runner, s), "stats": {"alone_s": runner.alone_s,
                                                     "cpu_s": time.process_time() - cpu_started}}


def check(runner: Runner, s: Schedule) -> dict:
    """Schedule ``s`` together, then each request alone: the outcome ``run`` aggregates. An engine
    that raises or stops making progress fails the schedule, and the run goes on."""
    try:
        together, engine, steps = runner.together(s)
        mismatches = []
        for i, r in enumerate(s.requests):
            alone = runner.alone(s, r)
            fields = differences(together[i], alone)
            if together[i].error or alone.error:
                fields.append(f"error: {together[i].error or alone.error}")
            if fields:
                mismatches.append({"request": i, "fields": fields})
    except Exception as exc:  # noqa: BLE001
        return {"schedule": s, "requests": len(s.requests), "steps": 0, "tokens": 0, "preemptions": 0,
                "prefix_hit_tokens": 0, "coverage": [],
                "mismatches": [{"request": None, "fields": [f"raised {type(exc).__name__}: {exc}"]}]}
    return {"schedule": s, "requests": len(s.requests), "mismatches": mismatches, "steps": steps,
            "tokens": sum(len(o.token_ids) for o in together), "preemptions": engine.core.scheduler.num_preemptions,
            "prefix_hit_tokens": engine.core.blocks.prefix_hits, "coverage": _coverage(s, engine)}


def run(args) -> dict:
    quiet_libraries(args.threads if args.workers == 1 else None)
    started, cpu_started = time.monotonic(), time.process_time()
    indices = [args.replay] if args.replay is not None else list(range(args.start, args.start + args.schedules))
    result = {"command": " ".join(["python -m benchmarks.fuzz_engine"] + [shlex.quote(a) for a in args.argv]),
              "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": git_commit(Path(__file__).resolve().parents[1]), **versions(), "device": device_name(args),
              "negative_control": args.negative_control, "seed": args.seed, "families": args.families,
              "dtypes": args.dtypes, "model_overrides": {f: fuzz_overrides(f) for f in args.families},
              "max_requests": MAX_REQUESTS, "max_prompt": MAX_PROMPT, "max_new_tokens": MAX_NEW_TOKENS,
              "max_arrival": MAX_ARRIVAL, "max_extra_pages": MAX_EXTRA_PAGES, "max_speculative": MAX_SPECULATIVE,
              "start": indices[0],
              "schedules_requested": len(indices), "time_limit_s": args.time_limit_s, "workers": args.workers}
    totals = dict(schedules=0, requests=0, requests_unequal=0, schedules_unequal=0, steps=0, tokens=0,
                  preemptions=0, prefix_hit_tokens=0)
    table = {f"{f}/{d}": {"schedules": 0, "requests": 0, "requests_unequal": 0}
             for f in args.families for d in args.dtypes}
    coverage: dict[str, int] = {}
    failures: list[dict] = []
    stats = [{"alone_s": 0.0, "cpu_s": 0.0} for _ in range(args.workers)]
    stopped = False

    def summary(done: bool) -> dict:
        elapsed = time.monotonic() - started
        cpu = time.process_time() - cpu_started + (sum(s["cpu_s"] for s in stats) if args.workers > 1 else 0)
        failures.sort(key=lambda f: f["index"])
        return {**result, **totals, "elapsed_s": round(elapsed, 1), "cpu_s": round(cpu, 1),
                "alone_s": round(sum(s["alone_s"] for s in stats), 1), "stopped_by_time_limit": stopped,
                "finished": done, "per_model": table,
                "coverage": dict(sorted(coverage.items())), "failures": failures}

    bar = tqdm(total=len(indices), desc="engine fuzz" + (" (negative control)" if args.negative_control else ""),
               unit="schedule", file=sys.stderr, disable=args.quiet, dynamic_ncols=True)
    stream = outcomes(schedules, args, indices, args.workers)
    try:
        for worker, item in stream:
            stats[worker] = item["stats"]
            if item.get("stopped"):
                stopped = True
                continue
            s, unequal = item["schedule"], len(item["mismatches"])
            if args.replay is not None:
                bar.write(f"replay {s.describe()}", file=sys.stderr)
            for key in ("requests", "steps", "tokens", "preemptions", "prefix_hit_tokens"):
                totals[key] += item[key]
            totals["schedules"] += 1
            totals["requests_unequal"] += unequal
            totals["schedules_unequal"] += bool(unequal)
            cell = table[f"{s.family}/{s.dtype}"]
            cell["schedules"] += 1
            cell["requests"] += item["requests"]
            cell["requests_unequal"] += unequal
            for key in item["coverage"]:
                coverage[key] = coverage.get(key, 0) + 1
            if unequal:
                failures.append({**asdict(s), "mismatches": item["mismatches"], "replay": replay_command(args, s.index)})
                if not args.negative_control or len(failures) <= 3:
                    bar.write(f"MISMATCH {s.describe()}: {item['mismatches']}\n  replay: {failures[-1]['replay']}",
                              file=sys.stderr)
            bar.update(1)
            bar.set_postfix(requests=totals["requests"], unequal=totals["requests_unequal"], refresh=False)
            if args.out and totals["schedules"] % args.save_every == 0:
                write_json(summary(False), args.out)
    except BaseException as error:  # Ctrl-C, SIGTERM or a failed worker: keep what was done
        if args.out:
            write_json({**summary(False), "interrupted": f"{type(error).__name__}: {error}"[:2000]}, args.out)
        raise
    finally:
        stream.close()
        bar.close()
    out = summary(True)
    if args.out:
        write_json(out, args.out)
    return out


def replay_command(args, index: int) -> str:
    parts = ["python -m benchmarks.fuzz_engine", "--seed", str(args.seed), "--families", ",".join(args.families),
             "--dtypes", ",".join(args.dtypes), "--replay", str(index)]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.negative_control:
        parts.append("--negative-control")
    return " ".join(parts)


# The families the engine runs (not yet the hybrid ones, with Gated DeltaNet layers; gemma4's text model
# is gemma4_text's, drawn as that), then the other presets drawn as models of their own.
ENGINE_FAMILIES = sorted(name for name, adapter in FAMILIES.items() if adapter.linear_attention is None
                         and adapter.vision is None and not adapter.unpatched_modules) + PRESET_MODELS


def parse(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_engine", description="Random engine schedules, "
                                "every request compared bitwise with the same request alone in a fresh engine.")
    p.add_argument("--schedules", type=int, default=20, help="how many schedules to draw (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--families", type=lambda v: csv_choices(v, ENGINE_FAMILIES, "families"), default=ENGINE_FAMILIES)
    p.add_argument("--dtypes", type=lambda v: csv_choices(v, DTYPES, "dtypes"), default=list(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu (default; kernels in the Triton interpreter) or cuda")
    p.add_argument("--out", type=Path, default=None, help="JSON summary, rewritten every --save-every schedules")
    p.add_argument("--negative-control", action="store_true",
                   help="the same schedules with a linear that picks BLOCK_K by M: must report mismatches")
    p.add_argument("--replay", type=int, default=None, metavar="I", help="run schedule I only (same other options)")
    p.add_argument("--start", type=int, default=0, help="first schedule index (default 0)")
    p.add_argument("--time-limit-s", type=float, default=None, help="start no schedule after this many seconds")
    p.add_argument("--workers", type=int, default=1, help="worker processes, each taking every N-th schedule")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads per process")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.schedules < 1 or args.workers < 1 or (args.replay is not None and args.workers != 1):
        p.error("--schedules and --workers must be >= 1, and --workers 1 with --replay")
    if args.workers > 1 and args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    args.argv = argv
    return args


def main(argv=None) -> int:
    args = parse(argv)
    summary = run_or_stop("fuzz_engine", run, args)
    if isinstance(summary, int):
        return summary
    print(f"[fuzz_engine] {summary['schedules']} schedules, {summary['requests']} requests "
          f"({summary['tokens']} tokens, {summary['preemptions']} preemptions, {summary['prefix_hit_tokens']} "
          f"prefix-cache tokens), {summary['requests_unequal']} unequal, in {summary['elapsed_s']:.0f} s"
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return exit_status("fuzz_engine", summary, unequal="requests_unequal", unit="requests", groups="schedules",
                       what="the request alone", negative_control=args.negative_control)


if __name__ == "__main__":
    sys.exit(main())
