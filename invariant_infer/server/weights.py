"""``POST /update_weights_from_disk``: new weights from a checkpoint directory, with no response
ever computed on mixed weights.

The checkpoint is checked against the served model first (a bad one is refused and nothing
pauses). Then new generation requests get 503, the requests in flight finish on the old weights
(up to ``timeout`` seconds; past it the update is refused and nothing changes), the tensors are
copied in place between engine steps and the prefix cache is reset. A copy that fails halfway
(an I/O error after the check) leaves the weights mixed: generation stays refused until an
update succeeds."""
from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from ..engine import AsyncEngine
from ..training.weight_update import plan_weight_update
from .choices import ChoiceRunner
from ..errors import CheckpointError, EngineBusyError
from .errors import APIError
from .metrics import Metrics

DRAIN_POLL_S = 0.05
RETRY_AFTER = {"Retry-After": "1"}


class UpdateRefused(APIError):
    """OpenAI's error body, with SGLang's ``success`` and ``message`` beside it."""

    def body(self) -> dict:
        return {"success": False, "message": self.message, **super().body()}


class WeightUpdater:
    def __init__(self, async_engine: AsyncEngine, runner: ChoiceRunner, metrics: Metrics):
        self.async_engine, self.runner, self.metrics = async_engine, runner, metrics
        self.updating = False
        self.broken: str | None = None  # why generation stays refused after a failed copy

    def _refuse(self, result: str, status: int, message: str, code: str) -> UpdateRefused:
        self.metrics.weight_updates.labels(result).inc()
        return UpdateRefused(status, message, code=code, headers=RETRY_AFTER if status == 503 else None)

    async def update_from_disk(self, model_path: str, timeout: float) -> dict:
        """The response body of a successful update; raises ``UpdateRefused`` otherwise."""
        if self.updating:
            raise self._refuse("refused", 409, "another weight update is running", "update_in_progress")
        if self.async_engine.engine.tensor_parallel_size > 1:
            raise self._refuse("refused", 400, "weight updates are not supported with --tensor-parallel-size > 1 "
                               "(the other ranks hold their own shards); the old weights keep serving",
                               "unsupported_with_tensor_parallelism")
        self.updating = True
        self.metrics.weight_update_in_progress.set(1)
        try:
            try:
                plan = await run_in_threadpool(plan_weight_update, self.async_engine.engine.model, model_path)
            except CheckpointError as exc:
                raise self._refuse("refused", 400, f"{exc}; the old weights keep serving", "invalid_checkpoint") \
                    from None
            self.runner.paused = "the server is loading new weights; retry shortly"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while self.runner.in_flight:
                if loop.time() >= deadline:
                    raise self._refuse("timeout", 503, f"{self.runner.in_flight} sequences were still in flight "
                                       f"after {timeout} s; the weights were not changed", "drain_timeout")
                await asyncio.sleep(DRAIN_POLL_S)
            try:
                copied = await run_in_threadpool(self.async_engine.update_weights, lambda model: plan.apply())
            except EngineBusyError as exc:
                raise self._refuse("refused", 503, f"{exc}; the weights were not changed", "engine_busy") from None
            except Exception as exc:  # noqa: BLE001  (after the check: the copy stopped halfway)
                self.broken = (f"a weight update from {model_path} failed while copying ({type(exc).__name__}: "
                               f"{exc}); the weights are mixed: POST /update_weights_from_disk again")
                raise self._refuse("failed", 500, self.broken, "update_failed") from None
            self.broken = None
            self.metrics.weight_updates.labels("success").inc()
            return {"success": True, "message": f"loaded {copied} tensors from {model_path}; prefix cache reset"}
        finally:
            self.runner.paused = self.broken
            self.updating = False
            self.metrics.weight_update_in_progress.set(0)
