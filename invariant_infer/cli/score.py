"""``invariant-infer score``: a resumable, reproducible scoring job over a JSONL file.

Rows are keyed by ``id``. The output holds at most one row per id: on a re-run, a torn last
line is cut off, error rows are dropped (their lines are tried again) and ids that already
have a result are skipped. Rows are written whole, one write and a flush each; the file is
fsync'ed after every batch, and rewritten atomically at the end in the canonical order: error
rows by line, then result rows longest first (ties by line), the order of an uninterrupted run.

With ``--ray`` the same job runs as a Ray Data pipeline (one actor per worker, each holding the
wrapped model): lines are read, validated and resumed on the driver exactly as above, and result
rows are written as workers finish their tasks. A worker that dies is restarted (at most
``--max-restarts`` times) and its task retried; a row that kills its worker even alone, or whose
scoring raises, becomes an error row.

For a vision-language checkpoint (Qwen2.5-VL, Qwen3-VL), a row may hold ``images``: base64 ``data:``
URLs or image files (relative paths from the input file's folder), one per run of image tokens in
its ids; each image is processed alone and its tokens expanded.

``--lora NAME=PATH ...`` loads PEFT LoRA adapters (unmerged); a row's ``lora`` field names the one
it is scored with (absent or null: the base model), and its result row repeats it.

A pooled checkpoint (an embedder, a classifier, a cross-encoder, a reward model: a sentence-transformers
folder, a base model, a ``...ForSequenceClassification``; or any checkpoint with ``--task``) is scored
for its pooled outputs instead: a line holds ``text``, ``text_1`` + ``text_2`` (a pair) or
``input_ids`` (optionally ``token_type_ids``), and its result row an ``embedding`` (embed) or
``scores`` (the head's raw logits), ``num_tokens`` and the ``digest`` of those float32 values.

A checkpoint that is not a causal LM, an image-text-to-text model or a pooled model of a supported
family is refused by name before it is loaded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..scoring.job.ray import DEFAULT_BATCH_ROWS, DEFAULT_MAX_RESTARTS
from ..checkpoints.loading import DEVICES, DTYPES, check_architecture
from ..checkpoints.pooled_loading import check_pooled_architecture, pooling_task_of
from ..model.pooled_model import POOLING_TASKS
from ..scoring.core import DEFAULT_MAX_BATCH_TOKENS
from ..scoring.job.backends import LocalBackend, PooledBackend, RayBackend
from ..scoring.job.run import JobOptions, run_job
from ..errors import CheckpointLoadError, JobError, UnsupportedModelError
from ..model.support import require
from . import exit_codes
from .help_text import exit_status_epilog, plain


def parse_loras(values) -> dict[str, str]:
    """``["name=path", ...]`` -> {name: path}; raises JobError."""
    loras = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise JobError(f"--lora takes NAME=PATH, got {value!r}")
        if name in loras:
            raise JobError(f"--lora: the name {name!r} is given twice")
        loras[name] = path
    return loras


def pooled_task(args) -> str | None:
    """The pooling task the job runs (``--task``, else the checkpoint's own), None for a causal LM's
    token logprobs; refuses (JobError) the options pooled checkpoints do not take."""
    task = getattr(args, "task", None)
    if task is None and Path(args.model).is_dir():
        task = pooling_task_of(args.model)
    if task is None:
        return None
    for option, given in (("--lora", getattr(args, "lora", None)), ("--tokenizer", args.tokenizer),
                          ("--tensor-parallel-size", getattr(args, "tensor_parallel_size", 1) != 1)):
        if given:
            raise JobError(f"{option} is not supported for a pooled checkpoint ({task}): it is scored in one process "
                           "(or on --ray) with its own tokenizer")
    return task


def pooled_backend(args, task: str):
    check_pooled_architecture(args.model, task)  # before any worker starts
    if getattr(args, "ray", False):
        return RayBackend(args.model, dtype=args.dtype, device=args.device, address=args.ray_address,
                          num_workers=args.num_workers, gpus_per_worker=args.gpus_per_worker,
                          rows_per_task=args.rows_per_task, max_restarts=args.max_restarts, task=task)
    return PooledBackend.load(args.model, task=task, dtype=args.dtype, device=args.device)


def logprobs_backend(args):
    """The backend of a causal LM's token logprobs (one process, tensor-parallel ranks or Ray)."""
    tensor_parallel_size = getattr(args, "tensor_parallel_size", 1)
    if tensor_parallel_size < 1:
        raise JobError(f"--tensor-parallel-size must be at least 1, got {tensor_parallel_size}")
    if getattr(args, "ray", False) and tensor_parallel_size > 1:
        require("tensor_parallel_job", "ray")
    loras = parse_loras(getattr(args, "lora", None))
    if loras and getattr(args, "ray", False):
        require("lora", "ray")
    check_architecture(args.model, "ray" if getattr(args, "ray", False) else "scoring")  # before any rank starts
    if getattr(args, "ray", False):
        backend = RayBackend(args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                             address=args.ray_address, num_workers=args.num_workers,
                             gpus_per_worker=args.gpus_per_worker, rows_per_task=args.rows_per_task,
                             max_restarts=args.max_restarts)
    else:
        backend = LocalBackend.load(args.model, dtype=args.dtype, device=args.device,
                                    tensor_parallel_size=tensor_parallel_size, loras=loras,
                                    rank_failed_status=exit_codes.RANK_FAILED)
    return backend


def run(args) -> int:
    options = JobOptions(args.input, args.output, args.tokenizer or args.model, args.max_batch_tokens, args.verify)
    try:
        options.check()  # fatal problems first, before minutes of model loading
        task = pooled_task(args)
        backend = pooled_backend(args, task) if task is not None else logprobs_backend(args)
    except UnsupportedModelError as exc:
        print(f"score: {args.model}: {exc}", file=sys.stderr)
        return exit_codes.UNSUPPORTED_MODEL
    except (JobError, CheckpointLoadError) as exc:
        print(f"score: {exc}", file=sys.stderr)
        return exit_codes.REFUSED
    return _run_job(options, backend)


def _run_job(options: JobOptions, backend) -> int:
    try:
        summary = run_job(options, backend)
    except JobError as exc:
        print(f"score: {exc}", file=sys.stderr)
        return exit_codes.RANK_FAILED if exc.rank_failed else exit_codes.REFUSED
    finally:
        backend.close()
    if not summary.verified:
        return exit_codes.VERIFY_MISMATCH
    return exit_codes.ROW_ERRORS if summary.errors else exit_codes.OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a checkpoint directory of a supported family")
    parser.add_argument("--input", required=True, help="JSONL requests, one per line, each with an id")
    parser.add_argument("--output", required=True, help="JSONL results; an existing file is resumed")
    parser.add_argument("--tokenizer", help="tokenizer directory for text lines (default: --model)")
    parser.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                        help="padded tokens per batch (rows x longest); results do not depend on it")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--device", choices=DEVICES, help="default: cuda if available")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="ranks (processes, one GPU each on cuda) the model is sharded over, started and "
                             "stopped by this command; results are bitwise those of 1 (default: 1)")
    parser.add_argument("--lora", nargs="+", metavar="NAME=PATH",
                        help="PEFT LoRA adapter folders, run unmerged; a row's \"lora\" field picks one by NAME")
    parser.add_argument("--task", choices=POOLING_TASKS,
                        help="score a pooled checkpoint for this task (default: the checkpoint's own, read from its "
                             "files: embed, classify, score or reward; causal LMs: token logprobs)")
    parser.add_argument("--verify", type=int, default=0, metavar="K",
                        help="re-score K random rows alone and check their digests bitwise")
    ray = parser.add_argument_group("scale out on Ray Data (pip install -e \".[ray]\")")
    ray.add_argument("--ray", action="store_true",
                     help="run the job as a Ray Data pipeline: one actor per worker, each holding the model")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="the Ray cluster to run on (default: RAY_ADDRESS, else a local Ray for this job)")
    ray.add_argument("--num-workers", type=int, default=1, metavar="N", help="actors, each loading the model once")
    ray.add_argument("--gpus-per-worker", type=float, metavar="G",
                     help="GPUs per actor (default: 1 where the cluster has GPUs, else 0)")
    ray.add_argument("--rows-per-task", type=int, default=DEFAULT_BATCH_ROWS, metavar="R",
                     help="rows per Ray task (each task is packed by --max-batch-tokens); results do not depend on it")
    ray.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="N",
                     help="restarts of each actor before the job fails (-1: without limit; default %(default)s)")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("score", help="reproducible per-token logprobs for a JSONL file",
                                   description=plain(__doc__), epilog=exit_status_epilog(),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m invariant_infer.cli.score ...``: the score command on its own."""
    parser = argparse.ArgumentParser(prog="invariant-infer score", description=plain(__doc__),
                                     epilog=exit_status_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
