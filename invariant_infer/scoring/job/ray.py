"""Scoring on Ray Data: the same bits on any number of workers and machines.

``score_dataset`` maps a Ray Data dataset of requests to a dataset of result rows. Each worker is
one actor holding a model wrapped by ``make_invariant`` (loaded once per actor). Because the
forward pass is batch-invariant, which worker scores a row, and with which neighbours, cannot
change its bits: every row equals the single-process ``score_sequences`` / ``invariant-infer
score`` result, on one device kind and software stack.

Faults: a worker that dies is restarted (at most ``max_restarts`` times) and its task retried. A
small ledger actor records which rows each worker is scoring, so the retry scores the rows that
were in flight one at a time; a row that kills its worker again when alone becomes an error row
instead of being retried forever, and a row whose scoring raises becomes an error row at once.

Ray is an optional extra (``pip install -e ".[ray]"``); this module imports it lazily.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...checkpoints.loading import DTYPES, LazyTokenizer, is_vision_language_checkpoint, load_model, load_processor
from ...checkpoints.pooled_loading import load_pooled_model
from ...model.pooled_model import PooledInput
from ..pooled import PooledResult, check_pooled_input, parse_pooled_request, score_pooled_group
from ...model.families import text_config
from ..requests import parse_request, prepare_request_images, request_images
from ..core import DEFAULT_MAX_BATCH_TOKENS, ScoreResult, check_sequence, plan_batches, score_group
from ...errors import InvalidArgumentError, JobError

DEFAULT_BATCH_ROWS = 64
DEFAULT_MAX_RESTARTS = 3
KILLED_ALONE = "its worker died each time it scored this row: twice, the second time with this row alone"


def require_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('Ray Data is not installed: pip install -e ".[ray]" '
                          '(or pip install "ray[data]")') from exc
    return ray


def _plain(value):
    """Arrow / numpy values of one cell -> plain Python (lists of ints, str, None)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):  # a numpy NaN too (a column with no value at all)
        value = value.item()
    if isinstance(value, float) and value != value:  # NaN: a missing cell of a mixed dataset
        return None
    return value


def _fault_ledger_class():
    """The ledger's class, built in a function so that Ray ships it by value: the ledger's
    process then starts without importing this package (torch, transformers) and holds no model.

    The ledger holds the rows being scored, by key, each with whether it runs alone. A worker
    marks a group before scoring it and clears it after (a row that raises is caught, so only a
    dead worker leaves a mark). ``take_marks`` at the start of a task returns the task's rows
    that a dead attempt left marked, with how many times a worker has died scoring each, and
    whether the last time was alone."""

    class FaultLedger:
        def __init__(self):
            self.in_flight: dict[str, bool] = {}
            self.deaths: dict[str, int] = {}

        def take_marks(self, keys: list[str]) -> dict[str, tuple[int, bool]]:
            died = {}
            for key in keys:
                if key in self.in_flight:
                    self.deaths[key] = self.deaths.get(key, 0) + 1
                    died[key] = (self.deaths[key], self.in_flight.pop(key))
            return died

        def mark(self, keys: list[str], alone: bool) -> None:
            self.in_flight.update(dict.fromkeys(keys, alone))

        def clear(self, keys: list[str]) -> None:
            for key in keys:
                self.in_flight.pop(key, None)

    return FaultLedger


class _Scorer:
    """The per-actor callable: loads the model once, scores each batch of rows it is given."""

    def __init__(self, model: str, tokenizer: str | None, dtype: str | None, device: str | None,
                 max_batch_tokens: int, ledger):
        self.model = load_model(model, dtype=dtype, device=device)
        self.tokenizer = LazyTokenizer(tokenizer or model)
        self.max_batch_tokens, self.ledger = max_batch_tokens, ledger
        self.image_processor = (load_processor(model, None).image_processor
                                if is_vision_language_checkpoint(model) else None)

    def _request(self, row: dict) -> tuple[list[int], int, Any]:
        """(ids, prompt length, the processed images or None) of a row; its images (``request_images``:
        data: URLs, or files relative to the worker's folder) processed here, each alone."""
        record = {k: _plain(v) for k, v in row.items() if k != "prompt_length"}
        record = {k: v for k, v in record.items() if v is not None}
        prompt_length = _plain(row.get("prompt_length"))
        if prompt_length is not None:  # token ids with an explicit prompt length
            ids, prompt_length = list(record["input_ids"]), int(prompt_length)
        else:
            ids, prompt_length = parse_request(record, self.tokenizer)
        config, images = self.model.config, request_images(record, Path())
        if images is not None:
            ids, prompt_length, images = prepare_request_images(config, self.image_processor, ids, prompt_length,
                                                                images)
        check_sequence(ids, prompt_length, text_config(config).vocab_size, text_config(config).max_position_embeddings)
        return ids, prompt_length, images

    def _score(self, requests: dict[int, tuple[list[int], int, Any]], keys: list[str], results: list) -> None:
        """Score ``requests`` (row -> ids, prompt length, images) into ``results``, marking each group in the
        ledger while it runs. Rows a dead attempt left marked run alone; a row whose worker died
        twice, the second time with the row alone, is not scored again."""
        import ray
        rows = list(requests)
        died = ray.get(self.ledger.take_marks.remote([keys[i] for i in rows]))
        for i in rows:
            deaths, alone = died.get(keys[i], (0, False))
            if deaths >= 2 and alone:
                results[i] = KILLED_ALONE
        clean = [i for i in rows if keys[i] not in died]
        groups = [[clean[j] for j in group] for group in
                  plan_batches([len(requests[i][0]) for i in clean], self.max_batch_tokens)]
        groups += [[i] for i in rows if keys[i] in died and results[i] is None]
        for group in groups:
            group_keys = [keys[i] for i in group]
            ray.get(self.ledger.mark.remote(group_keys, len(group) == 1))
            scored = self._score_group([requests[i] for i in group])
            for i, result in zip(group, scored):
                results[i] = result
            ray.get(self.ledger.clear.remote(group_keys))

    def _score_group(self, group: list) -> list:
        return score_group(self.model, [r[0] for r in group], [r[1] for r in group], images=[r[2] for r in group])

    def _rows(self, batch: dict[str, np.ndarray]) -> tuple[list[dict], list]:
        """The batch's rows, each scored (a result, or an error message)."""
        names = list(batch)
        count = len(batch[names[0]]) if names else 0
        rows = [{name: batch[name][i] for name in names} for i in range(count)]
        keys = [repr(_plain(row.get("id"))) for row in rows]
        results: list[Any] = [None] * count
        requests = {}
        for i, row in enumerate(rows):
            try:
                requests[i] = self._request(row)
            except Exception as exc:  # an invalid row is an error row; the others still run
                results[i] = f"invalid row: {exc}"
        self._score(requests, keys, results)
        return rows, results

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        rows, results = self._rows(batch)
        scored = [r if isinstance(r, ScoreResult) else None for r in results]
        return {
            "id": [_plain(row.get("id")) for row in rows],
            "token_logprobs": [r and r.token_logprobs.tolist() for r in scored],
            "logprob": [r and r.logprob for r in scored],
            "num_tokens": [r and r.num_tokens for r in scored],
            "greedy": [r and r.greedy for r in scored],
            "digest": [r and r.digest for r in scored],
            "error": [r if isinstance(r, str) else None for r in results],
        }


class _PooledScorer(_Scorer):
    """The per-actor callable of a pooled checkpoint: holds its ``PooledModel``; each group of rows is one
    padded forward. A row: ``input_ids`` (and ``token_type_ids``), or the fields of ``scoring.pooled``."""

    def __init__(self, model: str, tokenizer: str | None, dtype: str | None, device: str | None,
                 max_batch_tokens: int, ledger, task: str):
        self.pooled = load_pooled_model(model, task=task, dtype=dtype, device=device)
        self.max_batch_tokens, self.ledger = max_batch_tokens, ledger

    def _request(self, row: dict) -> tuple[list[int], PooledInput]:
        record = {k: v for k, v in ((k, _plain(v)) for k, v in row.items()) if v is not None}
        if "input_ids" in record:
            inp = PooledInput(list(record["input_ids"]), record.get("token_type_ids"))
            check_pooled_input(inp, self.pooled)
        else:
            inp = parse_pooled_request(record, self.pooled)
        return inp.input_ids, inp

    def _score_group(self, group: list) -> list:
        return score_pooled_group(self.pooled, [inp for _, inp in group])

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        rows, results = self._rows(batch)
        scored = [r if isinstance(r, PooledResult) else None for r in results]
        return {
            "id": [_plain(row.get("id")) for row in rows],
            "values": [r and r.values.tolist() for r in scored],
            "field": [r and r.field for r in scored],
            "num_tokens": [r and r.num_tokens for r in scored],
            "digest": [r and r.digest for r in scored],
            "error": [r if isinstance(r, str) else None for r in results],
        }


def score_dataset(ds, model: str, *, tokenizer: str | None = None, dtype: str | None = None,
                  num_workers: int = 1, max_batch_tokens: int | None = None,
                  batch_size: int = DEFAULT_BATCH_ROWS, gpus_per_worker: float | None = None,
                  cpus_per_worker: float | None = None, device: str | None = None,
                  max_restarts: int = DEFAULT_MAX_RESTARTS, task: str | None = None):
    """A Ray Data dataset of requests -> a dataset of result rows (lazy; Ray runs it on consumption).

    ``ds`` rows have an ``id`` (any value, passed through; unique) and one of: ``input_ids`` (a
    list of token ids; ``prompt_length`` optional, default 1: every token after the first is
    scored), ``text``, ``prompt`` + ``completion`` (tokenized separately, no special tokens, with
    ``tokenizer`` or the model's own) or ``prompt_ids`` + ``completion_ids``, and for a vision-language
    checkpoint optionally ``images`` (as the score command's lines). Result rows: ``id``,
    ``token_logprobs``, ``logprob``, ``num_tokens``, ``greedy``, ``digest`` (as ``invariant-infer
    score``) and ``error``: None, or why the row has no result (an invalid row, a row whose scoring
    raises, a row that killed its worker alone), its other fields then None. Their order is Ray's,
    so key them by ``id``.

    ``model``: a checkpoint directory every worker can read, loaded once per actor in ``dtype``
    ("bf16", "fp16", "fp32"; default bf16 on CUDA, fp32 on CPU) and wrapped by ``make_invariant``.
    ``num_workers`` actors each take ``batch_size`` rows per task, scored in batches of at most
    ``max_batch_tokens`` padded tokens; neither changes any bit of a row. A worker that dies is
    restarted, at most ``max_restarts`` times (-1: without limit), and its task retried; the
    failed task's rows are not emitted, so no row is lost or duplicated. Once a worker has used
    its restarts, consuming the dataset raises Ray's ``ActorDiedError``.

    ``task``: a pooled checkpoint's task (``pooling_task_of``): each worker holds its ``PooledModel``; rows
    are ``input_ids`` (optionally ``token_type_ids``), ``text`` or ``text_1`` + ``text_2`` (with the model's
    own tokenizer), and result rows hold ``values`` (the embedding, or the head's logits), ``field``
    ("embedding" or "scores"), ``num_tokens``, ``digest`` and ``error``."""
    ray = require_ray()
    if dtype is not None and dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS if max_batch_tokens is None else max_batch_tokens
    if max_batch_tokens < 1:
        raise InvalidArgumentError("max_batch_tokens must be at least 1")
    if num_workers < 1 or batch_size < 1:
        raise InvalidArgumentError("num_workers and batch_size must be at least 1")
    if max_restarts < -1:
        raise InvalidArgumentError("max_restarts must be -1 (without limit) or at least 0")
    # Ray Data has no named parameter for restarts: they go in ray_remote_args (deprecated from Ray 2.60).
    remote_args: dict[str, Any] = {"max_restarts": max_restarts, "max_task_retries": -1}
    if gpus_per_worker:
        remote_args["num_gpus"] = gpus_per_worker
    if cpus_per_worker is not None:
        remote_args["num_cpus"] = cpus_per_worker
    ledger = ray.remote(num_cpus=0)(_fault_ledger_class()).remote()  # lives while the dataset holds its handle
    from ray.data import ActorPoolStrategy
    kwargs = {"model": str(model), "tokenizer": None if tokenizer is None else str(tokenizer), "dtype": dtype,
              "device": device, "max_batch_tokens": max_batch_tokens, "ledger": ledger}
    return ds.map_batches(
        _Scorer if task is None else _PooledScorer, batch_size=batch_size, batch_format="numpy",
        compute=ActorPoolStrategy(size=num_workers),
        fn_constructor_kwargs=kwargs if task is None else {**kwargs, "task": task}, **remote_args)


def score_requests(requests, model: str, *, tokenizer: str | None = None, dtype: str | None = None,
                   num_workers: int = 1, max_batch_tokens: int | None = None,
                   batch_size: int = DEFAULT_BATCH_ROWS, gpus_per_worker: float | None = None,
                   device: str | None = None, max_restarts: int = DEFAULT_MAX_RESTARTS, task: str | None = None):
    """Score requests (objects with ``ids`` and ``prompt_length``; with ``task``, a pooled checkpoint's,
    ``ids`` and ``token_type_ids``) on Ray; yields lists of ``(request, ScoreResult or PooledResult, or
    error message)`` as tasks complete (in Ray's order). Requests are
    sent longest first, as the single-process job packs them, so tasks hold similar lengths."""
    ray = require_ray()
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].ids))
    if not order:
        return
    if task is not None:  # a pooled checkpoint's rows: their tokens (and token types)
        items = [{"id": i, "input_ids": requests[i].ids, "token_type_ids": requests[i].token_type_ids}
                 for i in order]
    else:
        items = [{"id": i, "input_ids": requests[i].ids, "prompt_length": requests[i].prompt_length}
                 for i in order]
    for item in items:  # image sources (data: URLs, absolute paths) travel with their rows' expanded ids
        if requests[item["id"]].images is not None:
            item["images"] = requests[item["id"]].images
    blocks = max(1, min(len(items), -(-len(items) // batch_size)))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    results = score_dataset(ds, model, tokenizer=tokenizer, dtype=dtype, num_workers=num_workers,
                            max_batch_tokens=max_batch_tokens, batch_size=batch_size,
                            gpus_per_worker=gpus_per_worker, device=device, max_restarts=max_restarts, task=task)
    for batch in results.iter_batches(batch_size=None, batch_format="pyarrow"):
        out = []
        for row in batch.to_pylist():
            if row["error"] is not None:
                out.append((requests[row["id"]], row["error"]))
                continue
            if task is not None:
                result = PooledResult(torch.tensor(row["values"], dtype=torch.float32), row["field"], row["num_tokens"])
            else:
                result = ScoreResult(torch.tensor(row["token_logprobs"], dtype=torch.float32), bool(row["greedy"]))
            if result.digest != row["digest"]:  # the float32 values must survive the transfer bit for bit
                raise JobError(f"row {row['id']}: digest changed in transfer from the worker")
            out.append((requests[row["id"]], result))
        yield out
