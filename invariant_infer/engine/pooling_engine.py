"""The batching engine of a pooled model (embedder, cross-encoder, classifier, reward model): rows
(one tokenized input each) queue up in arrival order and one worker thread runs them in batches,
each batch one ``PooledModel.forward_rows`` call of at most ``max_num_batched_tokens`` padded
tokens (rows x the longest row) and ``max_num_seqs`` rows, so concurrent requests share batches and
a request's rows may span batches. ``forward_rows`` is batch-invariant, so each row's output is
bitwise what the row gives alone, whatever it ran with. A row longer than the budget runs alone.
A request's ``finish`` (e.g. ``PooledModel.embeddings``) runs on the worker too, on each row alone
[1, D]: every kernel launch stays on one thread."""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Future

import torch

from ..errors import InvalidArgumentError, RequestFailedError


class PoolingEngine:
    def __init__(self, model, *, max_num_batched_tokens: int = 2048, max_num_seqs: int = 64):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise InvalidArgumentError(f"PoolingEngine: max_num_batched_tokens ({max_num_batched_tokens}) and "
                                       f"max_num_seqs ({max_num_seqs}) must be >= 1")
        self.model, self.max_num_batched_tokens, self.max_num_seqs = model, max_num_batched_tokens, max_num_seqs
        self._queue: deque = deque()  # (PooledInput, Future, finish)
        self._wake = threading.Condition()
        self._stopped = False
        self.batches = 0              # forward_rows calls so far
        self.rows_done = 0
        self._worker = threading.Thread(target=self._run, name="pooling-engine", daemon=True)
        self._worker.start()

    def submit(self, inputs: list, finish=None) -> list[Future]:
        """Queue ``inputs`` (``PooledInput``s, checked by the caller) together; one future per row,
        each resolving to that row's output [D] (float32, on the CPU), through ``finish`` ([1, D] ->
        [1, D']) when given."""
        futures = [Future() for _ in inputs]
        with self._wake:
            if self._stopped:
                raise RequestFailedError("the pooling engine is shut down")
            self._queue.extend((inp, future, finish) for inp, future in zip(inputs, futures))
            self._wake.notify()
        return futures

    async def run(self, inputs: list, finish=None) -> torch.Tensor:
        """The outputs of ``inputs`` [N, D], awaited without blocking the event loop."""
        futures = self.submit(inputs, finish)
        rows = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return torch.stack(rows)

    def run_sync(self, inputs: list, finish=None) -> torch.Tensor:
        return torch.stack([f.result() for f in self.submit(inputs, finish)])

    def waiting(self) -> int:
        with self._wake:
            return len(self._queue)

    def _next_batch(self) -> list:
        """Rows from the queue's head while the padded batch fits the budget (at least one)."""
        batch, longest = [], 0
        while self._queue and len(batch) < self.max_num_seqs:
            inp = self._queue[0][0]
            widest = max(longest, len(inp.input_ids))
            if batch and widest * (len(batch) + 1) > self.max_num_batched_tokens:
                break
            batch.append(self._queue.popleft())
            longest = widest
        return batch

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                batch = self._next_batch()
            live = [row for row in batch if row[1].set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                with torch.no_grad():
                    out = self.model.forward_rows([inp for inp, _, _ in live]).detach().to("cpu")
            except BaseException as exc:  # noqa: BLE001  (each row's request answers it)
                for _, f, _ in live:
                    f.set_exception(exc)
                continue
            self.batches += 1
            self.rows_done += len(live)
            for i, (_, f, finish) in enumerate(live):
                try:
                    f.set_result((finish(out[i:i + 1]) if finish else out[i:i + 1])[0].clone())
                except BaseException as exc:  # noqa: BLE001
                    f.set_exception(exc)

    def shutdown(self) -> None:
        """Stop the worker after its batch; rows still queued fail."""
        with self._wake:
            self._stopped = True
            left = list(self._queue)
            self._queue.clear()
            self._wake.notify_all()
        for _, f, _ in left:
            if f.set_running_or_notify_cancel():
                f.set_exception(RequestFailedError("the pooling engine shut down"))
        if self._worker is not threading.current_thread():
            self._worker.join(timeout=60)
