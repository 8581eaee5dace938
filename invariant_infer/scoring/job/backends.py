"""The backends of the scoring job: one process holding the model (or rank 0 of
``TensorParallelRanks``, the model sharded over several), one process holding a pooled checkpoint's
``PooledModel``, or a Ray Data pipeline of actors each holding either. All score every row with the
same bits; the job does not know which runs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from transformers import AutoConfig

from .ray import DEFAULT_BATCH_ROWS, DEFAULT_MAX_RESTARTS, require_ray, score_requests
from ...errors import DeviceError, JobError, ScoringRequestError, TensorParallelError, UnsupportedModelError
from ...checkpoints.loading import (is_vision_language_checkpoint, load_model, load_processor,
                                    vision_language_config)
from ...checkpoints.pooled_loading import describe_pooled_model, load_pooled_model
from ...model.pooled_model import PooledInput
from ..pooled import PooledResult, score_pooled_group
from ..core import ScoreResult, plan_batches, score_group
from ..requests import prepare_request_images
from .run import Request
from ...model.executor import Executor, executor_for
from ...model.kinds import model_kinds
from ...model.lora import unwrap_peft
from ...model.patch import make_invariant, restore
from ...model.support import require
from ...parallel import TensorParallelRanks
from ...parallel.forced_exit import exit_later

Scored = Iterator[list[tuple[Request, ScoreResult | PooledResult | str]]]


def exit_if_stuck(exit_status: int):
    """What a rank's failure does to the job: it normally raises at once; if a collective still
    holds it, the process ends with ``exit_status`` (``exit_later``)."""
    def on_failure(message: str) -> None:
        exit_later(exit_status, f"score: {message}; the rows written so far are kept: re-run to resume")
    return on_failure


class LocalBackend:
    """The model in this process, batches packed by ``plan_batches``; with ``executor`` (e.g.
    ``TensorParallelRanks``, whose ``model`` this is), each batch runs through it, and ``close``
    stops it. ``loras`` (name -> PEFT adapter folder) wraps the model in a ``PeftModel`` holding them
    all, unmerged; each request runs the adapter its ``lora`` names (rows grouped by adapter).
    ``image_processor``: a vision-language checkpoint's, which processes each image of a batch's rows
    (the job counted their tokens from their sizes when it read them)."""

    def __init__(self, model, *, executor: Executor | None = None, loras: dict[str, str] | None = None,
                 image_processor=None):
        self.loras, self.peft_model = dict(loras or {}), None
        if self.loras:
            if executor is not None:
                _require_for_job("peft_model", "tensor_parallel", "--lora")
            require(model_kinds(model) | {"lora"}, "scoring", f"--lora: {model.config.model_type}")
            model = self.peft_model = _with_adapters(model, self.loras)
        self.model, self.config = unwrap_peft(model), model.config
        self.executor = executor_for(self.model, executor)
        self.image_processor = image_processor

    @classmethod
    def load(cls, path: str, *, dtype: str | None = None, device: str | None = None,
             tensor_parallel_size: int = 1, loras: dict[str, str] | None = None,
             rank_failed_status: int) -> LocalBackend:
        """``rank_failed_status``: the exit status of a process whose rank failed inside a collective."""
        try:
            if tensor_parallel_size == 1:
                model = load_model(path, dtype=dtype, device=device)
                image_processor = (load_processor(path, None).image_processor
                                   if is_vision_language_checkpoint(path) else None)
                return cls(model, loras=loras, image_processor=image_processor)
            if loras:
                _require_for_job("peft_model", "tensor_parallel", "--lora")
            ranks = TensorParallelRanks(path, tensor_parallel_size, dtype=dtype, device=device,
                                        on_failure=exit_if_stuck(rank_failed_status))
            return cls(ranks.model, executor=ranks)
        except JobError:
            raise
        except UnsupportedModelError as exc:
            where = f"--tensor-parallel-size {tensor_parallel_size}" if tensor_parallel_size > 1 else f"cannot load {path}"
            raise JobError(f"{where}: {exc}") from None
        except Exception as exc:
            raise JobError(f"cannot load {path}: {exc}") from None

    def score(self, requests: list[Request], max_batch_tokens: int) -> Scored:
        try:
            for lora in dict.fromkeys(r.lora for r in requests):  # each adapter's rows, then the next's
                group = [r for r in requests if r.lora == lora]
                with self._adapter(lora):
                    for batch in plan_batches([len(r.ids) for r in group], max_batch_tokens):
                        yield self._score_batch([group[i] for i in batch])
        except (TensorParallelError, DeviceError) as exc:  # no row's fault: the job ends, its rows kept
            raise JobError(f"{exc}; the rows written so far are kept: re-run to resume",
                           rank_failed=isinstance(exc, TensorParallelError)) from None

    def _score_batch(self, requests: list[Request]) -> list[tuple[Request, ScoreResult | str]]:
        """``score_group`` on one planned batch, each row's images processed again (a row whose images
        no longer load gets that error, the others are scored)."""
        images, failed = {}, {}
        for i, r in enumerate(requests):
            if r.images is not None:
                try:
                    images[i] = prepare_request_images(self.config, self.image_processor, r.ids, r.prompt_length,
                                                       r.images)[2]
                except ScoringRequestError as exc:
                    failed[i] = str(exc)
        rows = [i for i in range(len(requests)) if i not in failed]
        scored = score_group(self.model, [requests[i].ids for i in rows], [requests[i].prompt_length for i in rows],
                             executor=self.executor, images=[images.get(i) for i in rows]) if rows else []
        results = {**failed, **dict(zip(rows, scored))}
        return [(r, results[i]) for i, r in enumerate(requests)]

    def _adapter(self, lora: str | None):
        if self.peft_model is None:
            return contextlib.nullcontext()
        if lora is None:
            return self.peft_model.disable_adapter()
        self.peft_model.set_adapter(lora)
        return contextlib.nullcontext()

    def close(self) -> None:
        self.executor.close()


class PooledBackend:
    """A pooled checkpoint's ``PooledModel`` in this process: each planned batch (``plan_batches``) is one
    padded forward; a batch that raises runs again row by row (``score_pooled_group``)."""

    def __init__(self, pooled):
        self.pooled, self.config = pooled, pooled.config

    @classmethod
    def load(cls, path: str, *, task: str | None = None, dtype: str | None = None,
             device: str | None = None) -> PooledBackend:
        try:
            return cls(load_pooled_model(path, task=task, dtype=dtype, device=device))
        except UnsupportedModelError:
            raise
        except Exception as exc:
            raise JobError(f"cannot load {path}: {exc}") from None

    def score(self, requests: list[Request], max_batch_tokens: int) -> Scored:
        try:
            for batch in plan_batches([len(r.ids) for r in requests], max_batch_tokens):
                rows = [requests[i] for i in batch]
                scored = score_pooled_group(self.pooled, [PooledInput(r.ids, r.token_type_ids) for r in rows])
                yield list(zip(rows, scored))
        except DeviceError as exc:  # no row's fault: the job ends, its rows kept
            raise JobError(f"{exc}; the rows written so far are kept: re-run to resume") from None

    def close(self) -> None:
        pass


def _require_for_job(kinds, surface: str, option: str) -> None:
    """The support table's refusal, as the job's error (``JobError``, prefixed by the option)."""
    try:
        require(kinds, surface)
    except UnsupportedModelError as exc:
        raise JobError(f"{option}: {exc}") from None


def _with_adapters(model, loras: dict[str, str]):
    """A ``PeftModel`` over ``model`` holding every adapter of ``loras``, patched by ``make_invariant``
    after they are in (each LoRA layer must be patched)."""
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise JobError(f"--lora needs PEFT (pip install -e \".[lora]\"): {exc}") from None
    restore(model)
    peft_model = None
    for name, path in loras.items():
        try:
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(model, path, adapter_name=name)
            else:
                peft_model.load_adapter(path, adapter_name=name)
        except Exception as exc:
            raise JobError(f"--lora {name}={path}: cannot load the adapter: {exc}") from None
    try:
        return make_invariant(peft_model.eval())
    except UnsupportedModelError as exc:
        raise JobError(f"--lora: {exc}") from None


class RayBackend:
    """Actors on a Ray cluster (``address``; None: RAY_ADDRESS, else a local Ray started here and
    shut down by ``close``). The driver loads only the model's config, to validate lines."""

    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: str | None = None,
                 device: str | None = None, address: str | None = None, num_workers: int = 1,
                 gpus_per_worker: float | None = None, rows_per_task: int = DEFAULT_BATCH_ROWS,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, task: str | None = None):
        """``task``: a pooled checkpoint's task (``pooling_task_of``); its lines are read with its
        description (``describe_pooled_model``) and each worker holds its ``PooledModel``."""
        try:
            self.ray = require_ray()
        except ImportError as exc:
            raise JobError(f"--ray: {exc}") from None
        if num_workers < 1 or rows_per_task < 1:
            raise JobError("--num-workers and --rows-per-task must be at least 1")
        if max_restarts < -1:
            raise JobError("--max-restarts must be -1 (without limit) or at least 0")
        try:
            self.pooled = None if task is None else describe_pooled_model(model, task=task)
            self.config = AutoConfig.from_pretrained(model) if task is None else self.pooled.config
        except UnsupportedModelError:
            raise
        except Exception as exc:
            raise JobError(f"cannot load {model}: {exc}") from None
        try:  # the driver counts each line's image tokens from the images' sizes
            self.image_processor = (load_processor(model, None).image_processor
                                    if vision_language_config(self.config) else None)
        except Exception as exc:
            raise JobError(f"cannot load the image processor of {model}: {exc}") from None
        self.started_ray = not self.ray.is_initialized()
        if self.started_ray:
            try:
                self.ray.init(address=address)
            except Exception as exc:
                raise JobError(f"cannot start or reach Ray ({address or 'local'}): {exc}") from None
        if gpus_per_worker is None:  # one GPU per worker where the cluster has GPUs
            gpus_per_worker = 1 if self.ray.cluster_resources().get("GPU", 0) > 0 and device != "cpu" else 0
        self.max_restarts = max_restarts
        self.options = dict(tokenizer=tokenizer, dtype=dtype, device=device, num_workers=num_workers,
                            gpus_per_worker=gpus_per_worker or None, batch_size=rows_per_task,
                            max_restarts=max_restarts, task=task)
        self.model = model

    def score(self, requests: list[Request], max_batch_tokens: int) -> Scored:
        from ray.exceptions import ActorDiedError
        try:
            yield from score_requests(requests, self.model, max_batch_tokens=max_batch_tokens, **self.options)
        except ActorDiedError as exc:
            reason = str(exc).splitlines()[0]
            restarts = "its restarts" if self.max_restarts == -1 else f"{self.max_restarts} restarts"
            raise JobError(f"a Ray worker died after {restarts} (--max-restarts): {reason}; the rows written so far "
                           "are kept: re-run to resume") from None
        except Exception as exc:
            raise JobError(f"the Ray job failed: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        if self.started_ray:
            self.ray.shutdown()
