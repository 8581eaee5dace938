"""Scoring on Ray Data: the same bits on any number of workers and machines.

``score_dataset`` maps a Ray Data dataset of requests to a dataset of result rows. Each worker is
one actor holding a model wrapped by ``make_invariant`` (loaded once per actor). Because the
forward pass is batch-invariant, which worker scores a row, and with which neighbours, cannot
change its bits: every row equals the single-process ``score_sequences`` / ``invariant-infer
score`` result, on one device kind and software stack.

Ray is an optional extra (``pip install "invariant-infer[ray]"``); this module imports it lazily.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

DEFAULT_BATCH_ROWS = 64
# Testing hook: when this variable names an existing file, the first actor to remove it exits at
# once (as a killed worker would) before scoring its batch; Ray restarts it and retries the task.
CRASH_ONCE_ENV = "INVARIANT_INFER_CRASH_ONCE"
RESULT_COLUMNS = ("id", "token_logprobs", "logprob", "num_tokens", "greedy", "digest")


def require_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('Ray Data is not installed: pip install "invariant-infer[ray]" '
                          '(or pip install "ray[data]")') from exc
    return ray


def _plain(value):
    """Arrow / numpy values of one cell -> plain Python (lists of ints, str, None)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and value != value:  # NaN: a missing cell of a mixed dataset
        return None
    return value


class _Scorer:
    """The per-actor callable: loads the model once, scores each batch of rows it is given."""

    def __init__(self, model: str, tokenizer: str | None, dtype: str | None, device: str | None,
                 max_batch_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM

        from .patch import make_invariant
        from .scoring_cli import DTYPES, Tokenizer
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = DTYPES[dtype or ("bf16" if device == "cuda" else "fp32")]
        self.model = make_invariant(AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval())
        self.tokenizer = Tokenizer(tokenizer or model)
        self.max_batch_tokens = max_batch_tokens

    def _request(self, row: dict) -> tuple[list[int], int]:
        from .scoring import check_sequence
        from .scoring_cli import parse_request
        record = {k: _plain(v) for k, v in row.items() if k != "prompt_length"}
        record = {k: v for k, v in record.items() if v is not None}
        prompt_length = _plain(row.get("prompt_length"))
        if prompt_length is not None:  # token ids with an explicit prompt length (the CLI's form)
            ids, prompt_length = list(record["input_ids"]), int(prompt_length)
        else:
            ids, prompt_length = parse_request(record, self.tokenizer)
        config = self.model.config
        check_sequence(ids, prompt_length, config.vocab_size, config.max_position_embeddings)
        return ids, prompt_length

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        from .scoring import plan_batches, score_batch
        flag = os.environ.get(CRASH_ONCE_ENV)
        if flag:
            try:
                os.unlink(flag)  # only one actor wins the removal
            except OSError:
                pass
            else:
                os._exit(1)
        names = list(batch)
        count = len(batch[names[0]]) if names else 0
        rows = [{name: batch[name][i] for name in names} for i in range(count)]
        requests = []
        for row in rows:
            try:
                requests.append(self._request(row))
            except Exception as exc:
                raise ValueError(f"row with id {_plain(row.get('id'))!r}: {exc}") from None
        results: list[Any] = [None] * count
        for group in plan_batches([len(ids) for ids, _ in requests], self.max_batch_tokens):
            scored = score_batch(self.model, [requests[i][0] for i in group], [requests[i][1] for i in group])
            for i, result in zip(group, scored):
                results[i] = result
        return {
            "id": [_plain(row["id"]) for row in rows],
            "token_logprobs": [r.token_logprobs.tolist() for r in results],
            "logprob": [r.logprob for r in results],
            "num_tokens": [r.num_tokens for r in results],
            "greedy": [r.greedy for r in results],
            "digest": [r.digest for r in results],
        }


def score_dataset(ds, model: str, *, tokenizer: str | None = None, dtype: str | None = None,
                  num_workers: int = 1, max_batch_tokens: int | None = None,
                  batch_size: int = DEFAULT_BATCH_ROWS, gpus_per_worker: float | None = None,
                  cpus_per_worker: float | None = None, device: str | None = None,
                  max_restarts: int | None = None):
    """A Ray Data dataset of requests -> a dataset of result rows (lazy; Ray runs it on consumption).

    ``ds`` rows have an ``id`` (any value, passed through) and one of: ``input_ids`` (a list of
    token ids; ``prompt_length`` optional, default 1: every token after the first is scored),
    ``text``, ``prompt`` + ``completion`` (tokenized separately, no special tokens, with
    ``tokenizer`` or the model's own) or ``prompt_ids`` + ``completion_ids``. Rows must be valid
    (``invariant-infer score --ray`` validates lines on the driver first): an invalid row fails its
    task. Result rows: ``id``, ``token_logprobs``, ``logprob``, ``num_tokens``, ``greedy``,
    ``digest`` (as ``invariant-infer score``); their order is Ray's, so key them by ``id``.

    ``model``: a checkpoint directory every worker can read, loaded once per actor in ``dtype``
    ("bf16", "fp16", "fp32"; default bf16 on CUDA, fp32 on CPU) and wrapped by ``make_invariant``.
    ``num_workers`` actors each take ``batch_size`` rows per task, scored in batches of at most
    ``max_batch_tokens`` padded tokens; neither changes any bit of a row. A worker that dies is
    restarted and its task retried (Ray Data's default for actor pools: without limit; an int
    ``max_restarts`` caps the restarts); the failed task's rows are not emitted, so no row is lost
    or duplicated."""
    require_ray()
    from .scoring import DEFAULT_MAX_BATCH_TOKENS
    from .scoring_cli import DTYPES
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS if max_batch_tokens is None else max_batch_tokens
    if max_batch_tokens < 1:
        raise ValueError("max_batch_tokens must be at least 1")
    if num_workers < 1 or batch_size < 1:
        raise ValueError("num_workers and batch_size must be at least 1")
    remote_args: dict[str, Any] = {}
    if max_restarts is not None:  # else Ray Data's own default: restart, retry the task
        remote_args.update(max_restarts=max_restarts, max_task_retries=-1)
    if gpus_per_worker:
        remote_args["num_gpus"] = gpus_per_worker
    if cpus_per_worker is not None:
        remote_args["num_cpus"] = cpus_per_worker
    from ray.data import ActorPoolStrategy
    return ds.map_batches(
        _Scorer, batch_size=batch_size, batch_format="numpy", compute=ActorPoolStrategy(size=num_workers),
        fn_constructor_kwargs={"model": str(model), "tokenizer": None if tokenizer is None else str(tokenizer),
                               "dtype": dtype, "device": device, "max_batch_tokens": max_batch_tokens},
        **remote_args)


def score_requests(requests, model: str, *, tokenizer: str | None = None, dtype: str | None = None,
                   num_workers: int = 1, max_batch_tokens: int | None = None,
                   batch_size: int = DEFAULT_BATCH_ROWS, gpus_per_worker: float | None = None,
                   device: str | None = None, max_restarts: int | None = None):
    """Score the CLI's validated ``Request`` objects on Ray; yields ``(request, ScoreResult)`` lists
    as tasks complete (in Ray's order). Requests are sent longest first, as the single-process job
    packs them, so tasks hold sequences of similar lengths."""
    import torch

    from .scoring import ScoreResult
    ray = require_ray()
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].ids))
    if not order:
        return
    items = [{"id": i, "input_ids": requests[i].ids, "prompt_length": requests[i].prompt_length} for i in order]
    blocks = max(1, min(len(items), -(-len(items) // batch_size)))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    results = score_dataset(ds, model, tokenizer=tokenizer, dtype=dtype, num_workers=num_workers,
                            max_batch_tokens=max_batch_tokens, batch_size=batch_size,
                            gpus_per_worker=gpus_per_worker, device=device, max_restarts=max_restarts)
    for batch in results.iter_batches(batch_size=None, batch_format="pyarrow"):
        out = []
        for row in batch.to_pylist():
            result = ScoreResult(torch.tensor(row["token_logprobs"], dtype=torch.float32), bool(row["greedy"]))
            if result.digest != row["digest"]:  # the float32 values must survive the transfer bit for bit
                raise RuntimeError(f"row {row['id']}: digest changed in transfer from the worker")
            out.append((requests[row["id"]], result))
        yield out
