"""``invariant-infer score``: a resumable, reproducible scoring job over a JSONL file.

Rows are keyed by ``id``. The output holds at most one row per id: on a re-run, a torn last
line is cut off, error rows are dropped (their lines are tried again) and ids that already
have a result are skipped. Rows are written whole, one write and a flush each, in sorted
(longest first) order; the file is fsync'ed after every batch.

With ``--ray`` the same job runs as a Ray Data pipeline (one actor per worker, each holding the
wrapped model): lines are read, validated and resumed on the driver exactly as above, result rows
are written whole and fsync'ed as workers finish their tasks (in Ray's order), and at the end the
file is rewritten atomically in the canonical order: error rows by line, then result rows longest
first (ties by line), which is the order of an uninterrupted single-process run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .scoring import DEFAULT_MAX_BATCH_TOKENS, check_sequence, plan_batches, score_batch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REQUEST_FIELDS = (("input_ids",), ("text",), ("prompt", "completion"), ("prompt_ids", "completion_ids"))
KNOWN_FIELDS = {"id"} | {name for fields in REQUEST_FIELDS for name in fields}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
EXIT_LINE_ERRORS, EXIT_FATAL, EXIT_VERIFY_MISMATCH = 1, 2, 3


@dataclass
class Request:
    line: int
    id: object
    ids: list[int]
    prompt_length: int  # tokens before the first scored one


class LineError(ValueError):
    pass


def id_key(row_id) -> str:
    return json.dumps(row_id)  # keeps 1, 1.0, "1" and true apart


class Tokenizer:
    """Loads the tokenizer on first use, so jobs given only ids need none."""

    def __init__(self, path: str):
        self.path, self._tokenizer, self._error = path, None, None

    def encode(self, text, name: str) -> list[int]:
        if not isinstance(text, str):
            raise LineError(f"{name} must be a string")
        if self._tokenizer is None and self._error is None:
            try:
                from transformers import AutoTokenizer
                # transformers 5 builds an empty tokenizer from config.json alone: refuse that.
                if Path(self.path).is_dir() and not any((Path(self.path) / f).exists() for f in TOKENIZER_FILES):
                    raise OSError(f"none of {', '.join(TOKENIZER_FILES)} found")
                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            except Exception as exc:  # reported per text line; id lines still run
                self._error = f"cannot tokenize: no tokenizer loaded from {self.path} ({exc}); pass --tokenizer"
        if self._error:
            raise LineError(self._error)
        return self._tokenizer.encode(text, add_special_tokens=False)


def token_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise LineError(f"{name} must be a list of integers")
    return value


def parse_request(record: dict, tokenizer: Tokenizer) -> tuple[list[int], int]:
    """(token ids, prompt length) of one input record; raises LineError."""
    fields = set(record) - {"id"}
    unknown = sorted(fields - KNOWN_FIELDS)
    if unknown:
        raise LineError(f"unknown field(s) {unknown}")
    if ("input_ids",) == tuple(fields):
        return token_list(record["input_ids"], "input_ids"), 1
    if ("text",) == tuple(fields):
        return tokenizer.encode(record["text"], "text"), 1
    if fields == {"prompt", "completion"}:
        prompt = tokenizer.encode(record["prompt"], "prompt")
        completion = tokenizer.encode(record["completion"], "completion")
        return prompt + completion, len(prompt)
    if fields == {"prompt_ids", "completion_ids"}:
        prompt = token_list(record["prompt_ids"], "prompt_ids")
        return prompt + token_list(record["completion_ids"], "completion_ids"), len(prompt)
    for needed in REQUEST_FIELDS:
        if fields and fields <= set(needed):
            raise LineError(f"missing field(s) {sorted(set(needed) - fields)}")
    expected = " | ".join("+".join(f) for f in REQUEST_FIELDS)
    raise LineError(f"need exactly one of {expected}; got {sorted(fields) or 'none'}")


def recover_output(path: Path) -> dict[str, str]:
    """Repair ``path`` after a crash and return {id key: digest} of the rows it keeps.

    Cuts a torn last line, drops error rows (their lines are re-tried) and any repeated id."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]  # a line without its newline was torn by a crash
    kept, digests = [], {}
    for raw in complete.splitlines(keepends=True):
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict) and "digest" in row and id_key(row.get("id")) not in digests:
            digests[id_key(row["id"])] = row["digest"]
            kept.append(raw)
    if len(kept) != len(complete.splitlines()) or len(complete) != len(data):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one
    return digests


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_requests(path: str, tokenizer: Tokenizer, config, done: dict[str, str], write_error):
    """All valid requests (including ids already done), and the count of non-blank lines."""
    requests, first_line, lines = [], {}, 0
    with open(path, "rb") as f:  # decoded line by line: one bad byte fails its line, not the job
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            lines += 1
            row_id = None
            try:
                try:
                    text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise LineError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
                try:
                    record = json.loads(text, parse_constant=_reject_constant)
                except json.JSONDecodeError as exc:  # the decoder's own "line 1" would be misleading
                    raise LineError(f"malformed JSON: {exc.msg} at column {exc.colno}") from None
                except ValueError as exc:  # NaN / Infinity
                    raise LineError(f"malformed JSON: {exc}") from None
                if not isinstance(record, dict):
                    raise LineError("expected a JSON object")
                if "id" not in record:
                    raise LineError("missing field 'id'")
                if record["id"] is None or isinstance(record["id"], (dict, list)) or \
                        (isinstance(record["id"], float) and not math.isfinite(record["id"])):
                    raise LineError("id must be a JSON string, finite number or boolean")
                key = id_key(record["id"])
                if key in first_line:  # the output keeps one row per id; this line's row gets id null
                    raise LineError(f"duplicate id {key} (first on line {first_line[key]})")
                first_line[key] = n
                row_id = record["id"]
                ids, prompt_length = parse_request(record, tokenizer)
                try:
                    check_sequence(ids, prompt_length, config.vocab_size, config.max_position_embeddings)
                except ValueError as exc:
                    raise LineError(str(exc)) from None
                requests.append(Request(n, row_id, ids, prompt_length))
            except LineError as exc:
                if id_key(row_id) not in done:
                    write_error(n, row_id, str(exc))
    return requests, lines


def load_model(args):
    from transformers import AutoModelForCausalLM

    from .patch import make_invariant
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    return make_invariant(model)


def result_row(request: Request, result) -> dict:
    return {"id": request.id, "token_logprobs": result.token_logprobs.tolist(), "logprob": result.logprob,
            "num_tokens": result.num_tokens, "greedy": result.greedy, "digest": result.digest}


def pick_for_verify(requests: list[Request], digests: dict[str, str], k: int) -> list[Request]:
    candidates = [r for r in requests if id_key(r.id) in digests]
    return random.Random(0).sample(candidates, min(k, len(candidates)))


def verify(model, requests: list[Request], digests: dict[str, str], k: int) -> bool:
    """Re-score k random finished rows alone (batch of one) and compare digests bitwise."""
    picked = pick_for_verify(requests, digests, k)
    return report_verify(picked, {id_key(r.id): score_batch(model, [r.ids], [r.prompt_length])[0].digest
                                  for r in picked}, digests)


def report_verify(picked: list[Request], rescored: dict[str, str], digests: dict[str, str]) -> bool:
    mismatched = [r.id for r in picked if rescored.get(id_key(r.id)) != digests[id_key(r.id)]]
    if mismatched:
        print(f"verify: MISMATCH: {len(mismatched)} of {len(picked)} rows re-scored alone differ: ids "
              f"{mismatched[:10]}", file=sys.stderr)
    else:
        print(f"verify: {len(picked)} of {len(picked)} rows re-scored alone match their digests bitwise",
              file=sys.stderr)
    return not mismatched


def run(args) -> int:
    started = time.perf_counter()
    if args.max_batch_tokens < 1:
        print("score: --max-batch-tokens must be at least 1", file=sys.stderr)
        return EXIT_FATAL
    output = Path(args.output)
    # Fatal problems first, before minutes of model loading.
    if not os.access(args.input, os.R_OK) or not Path(args.input).is_file():
        print(f"score: cannot read --input {args.input}", file=sys.stderr)
        return EXIT_FATAL
    if not output.parent.is_dir():
        print(f"score: the folder of --output {args.output} does not exist", file=sys.stderr)
        return EXIT_FATAL
    use_ray = getattr(args, "ray", False)
    if use_ray:
        try:
            from .distributed import require_ray
            ray = require_ray()
        except ImportError as exc:
            print(f"score: --ray: {exc}", file=sys.stderr)
            return EXIT_FATAL
        if args.num_workers < 1 or args.rows_per_task < 1:
            print("score: --num-workers and --rows-per-task must be at least 1", file=sys.stderr)
            return EXIT_FATAL
    try:
        if use_ray:  # the workers load the model; the driver needs its config to validate lines
            from transformers import AutoConfig
            model, config = None, AutoConfig.from_pretrained(args.model)
        else:
            model = load_model(args)
            config = model.config
    except Exception as exc:
        print(f"score: cannot load {args.model}: {exc}", file=sys.stderr)
        return EXIT_FATAL
    started_ray = False
    if use_ray and not ray.is_initialized():
        try:  # address None: RAY_ADDRESS if set, else a local Ray for this job
            ray.init(address=args.ray_address)
        except Exception as exc:
            print(f"score: cannot start or reach Ray ({args.ray_address or 'local'}): {exc}", file=sys.stderr)
            return EXIT_FATAL
        started_ray = True
    try:
        return _run_job(args, model, config, started)
    except Exception as exc:
        if not use_ray:
            raise
        # Rows already written stay in --output: a re-run resumes from them.
        print(f"score: the Ray job failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FATAL
    finally:
        if started_ray:
            ray.shutdown()


def ray_options(args) -> dict:
    """score_requests keyword arguments from the --ray flags."""
    import ray
    gpus = args.gpus_per_worker
    if gpus is None:  # one GPU per worker where the cluster has GPUs
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 and args.device != "cpu" else 0
    return {"tokenizer": args.tokenizer, "dtype": args.dtype, "device": args.device,
            "num_workers": args.num_workers, "gpus_per_worker": gpus or None, "batch_size": args.rows_per_task}


def canonical_order(path: Path, requests: list[Request]) -> None:
    """Rewrite ``path`` atomically: error rows by line, then result rows longest first (ties by
    line), then rows of ids not in the input, as they were."""
    by_key = {id_key(r.id): r for r in requests}
    rows = [(raw, json.loads(raw)) for raw in path.read_bytes().splitlines(keepends=True) if raw.strip()]
    errors = sorted((r for r in rows if "error" in r[1]), key=lambda r: r[1].get("line", 0))
    known = [r for r in rows if "error" not in r[1] and id_key(r[1].get("id")) in by_key]
    known.sort(key=lambda r: (-len(by_key[id_key(r[1]["id"])].ids), by_key[id_key(r[1]["id"])].line))
    other = [r for r in rows if "error" not in r[1] and id_key(r[1].get("id")) not in by_key]
    ordered = [raw for raw, _ in errors + known + other]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(ordered)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _run_job(args, model, config, started: float) -> int:
    from tqdm import tqdm
    output = Path(args.output)
    use_ray = model is None
    try:
        digests = recover_output(output)
        out = open(output, "a", encoding="utf-8")
    except OSError as exc:
        print(f"score: cannot write --output {args.output}: {exc}", file=sys.stderr)
        return EXIT_FATAL
    errors = 0

    def write_row(row: dict) -> None:
        out.write(json.dumps(row, allow_nan=False) + "\n")  # one write per row: a crash tears at most the last
        out.flush()

    def write_error(line: int, row_id, message: str) -> None:
        nonlocal errors
        errors += 1
        print(f"{args.input}:{line}: {message}", file=sys.stderr)
        write_row({"id": row_id, "line": line, "error": message})

    with out:
        requests, lines = read_requests(args.input, Tokenizer(args.tokenizer or args.model), config,
                                        digests, write_error)
        pending = [r for r in requests if id_key(r.id) not in digests]
        tokens = sum(len(r.ids) for r in pending)
        scoring_started = time.perf_counter()
        bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc="score", file=sys.stderr, smoothing=0.1)
        if use_ray:
            from .distributed import score_requests
            os.fsync(out.fileno())
            batches = score_requests(pending, args.model, max_batch_tokens=args.max_batch_tokens,
                                     **ray_options(args))
        else:
            batches = ([(pending[i], result) for i, result in zip(batch, score_batch(
                model, [pending[i].ids for i in batch], [pending[i].prompt_length for i in batch]))]
                for batch in plan_batches([len(r.ids) for r in pending], args.max_batch_tokens))
        for batch in batches:
            for request, result in batch:
                if id_key(request.id) in digests:  # never two rows for one id
                    continue
                row = result_row(request, result)
                write_row(row)
                digests[id_key(request.id)] = row["digest"]
            os.fsync(out.fileno())
            bar.update(sum(len(r.ids) for r, _ in batch))
        bar.close()
    if use_ray:
        canonical_order(output, requests)
    now = time.perf_counter()
    scoring_time = max(now - scoring_started, 1e-9)
    print(f"score: {lines} lines: {len(pending)} scored, {len(requests) - len(pending)} already in output, "
          f"{errors} errors; {tokens} tokens in {scoring_time:.1f} s ({tokens / scoring_time:.1f} tokens/s); "
          f"{now - started:.1f} s in all", file=sys.stderr)
    if args.verify <= 0:
        verified = True
    elif use_ray:  # on the workers' device kind, each row alone
        from .distributed import score_requests
        picked = pick_for_verify(requests, digests, args.verify)
        rescored = {id_key(r.id): result.digest for batch in score_requests(
            picked, args.model, max_batch_tokens=1, **{**ray_options(args), "batch_size": 1})
            for r, result in batch}
        verified = report_verify(picked, rescored, digests)
    else:
        verified = verify(model, requests, digests, args.verify)
    if not verified:
        return EXIT_VERIFY_MISMATCH
    return EXIT_LINE_ERRORS if errors else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="checkpoint directory of a supported family (qwen2, qwen3, llama, mistral)")
    parser.add_argument("--input", required=True, help="JSONL requests, one per line, each with an id")
    parser.add_argument("--output", required=True, help="JSONL results; an existing file is resumed")
    parser.add_argument("--tokenizer", help="tokenizer directory for text lines (default: --model)")
    parser.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                        help="padded tokens per batch (rows x longest); results do not depend on it")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    parser.add_argument("--verify", type=int, default=0, metavar="K",
                        help="re-score K random rows alone and check their digests bitwise")
    ray = parser.add_argument_group("scale out on Ray Data (pip install \"invariant-infer[ray]\")")
    ray.add_argument("--ray", action="store_true",
                     help="run the job as a Ray Data pipeline: one actor per worker, each holding the model")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="the Ray cluster to run on (default: RAY_ADDRESS, else a local Ray for this job)")
    ray.add_argument("--num-workers", type=int, default=1, metavar="N", help="actors, each loading the model once")
    ray.add_argument("--gpus-per-worker", type=float, metavar="G",
                     help="GPUs per actor (default: 1 where the cluster has GPUs, else 0)")
    ray.add_argument("--rows-per-task", type=int, default=64, metavar="R",
                     help="rows per Ray task (each task is packed by --max-batch-tokens); results do not depend on it")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("score", help="reproducible per-token logprobs for a JSONL file",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m invariant_infer.scoring_cli ...``: the score command on its own."""
    parser = argparse.ArgumentParser(prog="invariant-infer score", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
