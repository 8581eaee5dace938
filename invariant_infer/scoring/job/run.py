"""The scoring job behind ``invariant-infer score``: a resumable, reproducible job over a JSONL file.

Rows are keyed by ``id``. The output holds at most one row per id: on a re-run, a torn last line
is cut off, error rows are dropped (their lines are tried again) and ids that already have a
result are skipped. Rows are written whole, one write and a flush each, as batches finish; the
file is fsync'ed after every batch. When the job ends, the file is rewritten atomically in the
canonical order: error rows by line, then result rows longest first (ties by line), which is the
order an uninterrupted single-process run writes them in.

The job validates lines and writes rows; a backend (``scoring_backends``: one process, or Ray
Data) scores the valid requests.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Protocol

from tqdm import tqdm

from ...checkpoints.loading import LazyTokenizer
from ..requests import count_request_images, parse_request, request_images, request_lora
from ...model.families import text_config
from ..core import DEFAULT_MAX_BATCH_TOKENS, ScoreResult, check_sequence
from ..pooled import PooledResult, parse_pooled_request
from ...errors import InvalidArgumentError, JobError, ScoringRequestError


@dataclass
class Request:
    line: int
    id: object
    ids: list[int]
    prompt_length: int  # tokens before the first scored one
    lora: str | None = None  # the LoRA adapter it is scored with (None: the base model)
    images: list[str] | None = None  # image sources, processed again when scored (ids: their tokens expanded)
    token_type_ids: list[int] | None = None  # a pooled model's row: its token types, where its tokenizer gives them


class Backend(Protocol):
    """Scores the job's valid requests. ``config`` is the model's (``vocab_size``,
    ``max_position_embeddings``), for validating lines before any scoring; ``image_processor`` (None: lines
    with images are refused) processes each image of a vision-language checkpoint's lines."""
    config: object
    image_processor: object

    def score(self, requests: list[Request], max_batch_tokens: int) -> Iterator[list[tuple[Request, ScoreResult | str]]]:
        """Batches of (request, result or error message), in any order; raises JobError."""

    def close(self) -> None:
        """Release what the backend holds (a Ray it started)."""


def id_key(row_id) -> str:
    return json.dumps(row_id)  # keeps 1, 1.0, "1" and true apart


def atomic_write(path: Path, lines: Iterable[bytes]) -> None:
    """Replace ``path`` with ``lines``: a crash leaves the old file or the new one, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        atomic_write(path, kept)
    return digests


def _reject_constant(name: str):
    raise InvalidArgumentError(f"{name} is not valid JSON")


def _record(raw: bytes, n: int) -> dict:
    """Line ``n`` -> its JSON object, with a valid id; raises ScoringRequestError."""
    try:
        text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise ScoringRequestError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        record = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:  # the decoder's own "line 1" would be misleading
        raise ScoringRequestError(f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    except ValueError as exc:  # NaN / Infinity
        raise ScoringRequestError(f"malformed JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ScoringRequestError("expected a JSON object")
    if "id" not in record:
        raise ScoringRequestError("missing field 'id'")
    row_id = record["id"]
    if row_id is None or isinstance(row_id, (dict, list)) or (isinstance(row_id, float) and not math.isfinite(row_id)):
        raise ScoringRequestError("id must be a JSON string, finite number or boolean")
    return record


def read_requests(path: str, tokenizer: LazyTokenizer, config, done: dict[str, str], write_error, loras=(),
                  image_processor=None, pooled=None):
    """All valid requests (including ids already done), and the count of non-blank lines. Each
    invalid line whose id has no result yet goes to ``write_error(line, id or None, message)``.
    ``pooled``: a pooled checkpoint's ``PooledModel`` (its weights need not be loaded), whose requests
    (``scoring.pooled``) the lines are read as."""
    requests, first_line, lines = [], {}, 0
    folder, limits = Path(path).resolve().parent, text_config(config)
    with open(path, "rb") as f:  # decoded line by line: one bad byte fails its line, not the job
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            lines += 1
            row_id = None
            try:
                record = _record(raw, n)
                key = id_key(record["id"])
                if key in first_line:  # the output keeps one row per id; this line's row gets id null
                    raise ScoringRequestError(f"duplicate id {key} (first on line {first_line[key]})")
                first_line[key] = n
                row_id = record["id"]
                if pooled is not None:
                    row = parse_pooled_request(record, pooled)
                    requests.append(Request(n, row_id, row.input_ids, 0, token_type_ids=row.token_type_ids))
                    continue
                ids, prompt_length = parse_request(record, tokenizer)
                lora = request_lora(record, loras)
                images = request_images(record, folder)
                if images is not None:  # their tokens counted from their sizes here, their pixels processed when scored
                    ids, prompt_length = count_request_images(config, image_processor, ids, prompt_length, images)
                try:
                    check_sequence(ids, prompt_length, limits.vocab_size, limits.max_position_embeddings)
                except ValueError as exc:
                    raise ScoringRequestError(str(exc)) from None
                requests.append(Request(n, row_id, ids, prompt_length, lora, images))
            except ScoringRequestError as exc:
                if id_key(row_id) not in done:
                    write_error(n, row_id, str(exc))
    return requests, lines


def canonical_order(path: Path, requests: list[Request]) -> None:
    """Rewrite ``path`` (atomically, if its order differs): error rows by line, then result rows
    longest first (ties by line), then rows of ids not in the input, as they were."""
    by_key = {id_key(r.id): r for r in requests}
    data = path.read_bytes()
    rows = [(raw, json.loads(raw)) for raw in data.splitlines(keepends=True) if raw.strip()]
    errors = sorted((r for r in rows if "error" in r[1]), key=lambda r: r[1].get("line", 0))
    known = [r for r in rows if "error" not in r[1] and id_key(r[1].get("id")) in by_key]
    known.sort(key=lambda r: (-len(by_key[id_key(r[1]["id"])].ids), by_key[id_key(r[1]["id"])].line))
    other = [r for r in rows if "error" not in r[1] and id_key(r[1].get("id")) not in by_key]
    ordered = [raw for raw, _ in errors + known + other]
    if b"".join(ordered) != data:
        atomic_write(path, ordered)


def result_row(request: Request, result: ScoreResult | PooledResult) -> dict:
    if isinstance(result, PooledResult):
        return {"id": request.id, result.field: result.values.tolist(), "num_tokens": result.num_tokens,
                "digest": result.digest}
    row = {"id": request.id, "token_logprobs": result.token_logprobs.tolist(), "logprob": result.logprob,
           "num_tokens": result.num_tokens, "greedy": result.greedy, "digest": result.digest}
    return row if request.lora is None else {**row, "lora": request.lora}


@dataclass
class JobOptions:
    input: str
    output: str
    tokenizer: str  # for text lines
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    verify: int = 0  # rows re-scored alone at the end
    started: float = field(default_factory=time.perf_counter)

    def check(self) -> None:
        """The fatal problems a job can see before a model is loaded; raises JobError."""
        if self.max_batch_tokens < 1:
            raise JobError("--max-batch-tokens must be at least 1")
        if not os.access(self.input, os.R_OK) or not Path(self.input).is_file():
            raise JobError(f"cannot read --input {self.input}")
        if not Path(self.output).parent.is_dir():
            raise JobError(f"the folder of --output {self.output} does not exist")


@dataclass
class JobSummary:
    errors: int  # error rows written
    verified: bool  # True unless --verify found a mismatch


def verify(backend: Backend, requests: list[Request], digests: dict[str, str], k: int) -> bool:
    """Re-score k random finished rows, each alone, and compare digests bitwise."""
    candidates = [r for r in requests if id_key(r.id) in digests]
    picked = random.Random(0).sample(candidates, min(k, len(candidates)))
    rescored = {id_key(r.id): result.digest for batch in backend.score(picked, 1)
                for r, result in batch if not isinstance(result, str)}
    mismatched = [r.id for r in picked if rescored.get(id_key(r.id)) != digests[id_key(r.id)]]
    if mismatched:
        print(f"verify: MISMATCH: {len(mismatched)} of {len(picked)} rows re-scored alone differ: ids "
              f"{mismatched[:10]}", file=sys.stderr)
    else:
        print(f"verify: {len(picked)} of {len(picked)} rows re-scored alone match their digests bitwise",
              file=sys.stderr)
    return not mismatched


def run_job(options: JobOptions, backend: Backend) -> JobSummary:
    """Validate, resume, score and write the job's rows; raises JobError."""
    output = Path(options.output)
    try:
        digests = recover_output(output)
        out = open(output, "a", encoding="utf-8")
    except OSError as exc:
        raise JobError(f"cannot write --output {options.output}: {exc}") from None
    errors = scored = 0

    def write_row(row: dict) -> None:
        out.write(json.dumps(row, allow_nan=False) + "\n")  # one write per row: a crash tears at most the last
        out.flush()

    def write_error(line: int, row_id, message: str) -> None:
        nonlocal errors
        errors += 1
        print(f"{options.input}:{line}: {message}", file=sys.stderr)
        write_row({"id": row_id, "line": line, "error": message})

    with out:
        requests, lines = read_requests(options.input, LazyTokenizer(options.tokenizer), backend.config,
                                        digests, write_error, getattr(backend, "loras", {}),
                                        getattr(backend, "image_processor", None), getattr(backend, "pooled", None))
        os.fsync(out.fileno())
        pending = [r for r in requests if id_key(r.id) not in digests]
        tokens = sum(len(r.ids) for r in pending)
        scoring_started = time.perf_counter()
        bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc="score", file=sys.stderr, smoothing=0.1)
        for batch in backend.score(pending, options.max_batch_tokens):
            for request, result in batch:
                if id_key(request.id) in digests:  # never two rows for one id
                    continue
                if isinstance(result, str):  # a row that fails alone: an error row, retried on a re-run
                    write_error(request.line, request.id, result)
                    continue
                row = result_row(request, result)
                write_row(row)
                digests[id_key(request.id)] = row["digest"]
                scored += 1
            os.fsync(out.fileno())
            bar.update(sum(len(r.ids) for r, _ in batch))
        bar.close()
    canonical_order(output, requests)
    now = time.perf_counter()
    scoring_time = max(now - scoring_started, 1e-9)
    print(f"score: {lines} lines: {scored} scored, {len(requests) - len(pending)} already in output, "
          f"{errors} errors; {tokens} tokens in {scoring_time:.1f} s ({tokens / scoring_time:.1f} tokens/s); "
          f"{now - options.started:.1f} s in all", file=sys.stderr)
    verified = options.verify <= 0 or verify(backend, requests, digests, options.verify)
    return JobSummary(errors=errors, verified=verified)
