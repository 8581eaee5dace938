"""asyncio front for the engine: one background thread runs the core's steps while requests are
in flight; each request is an async iterator of its outputs, of its ``output_kind``.

It drives its engine's core (``engine.core``) through the engine's frontend (``engine.frontend``, the
one ``Engine`` uses). The engine's lock holds only the core: tokenizing a prompt, decoding the text,
stop strings and building outputs run outside it (each request's ``OutputProcessor``, in its own
iterator), so one long prompt or a slow client never stalls a step. The core hands each request
its deltas; a stop string found by the frontend aborts the request in the core.

The event loop never waits for a step: adding a request waits for the engine's lock in an
executor thread, and an abort is queued for the engine thread to apply before its next step.

``update_weights(update)`` runs ``update(model)`` between steps on an idle engine, then resets
the prefix cache: no step ever runs on half-updated weights."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from .engine import Engine, RequestOutput
from .output import end_delta
from .sampling_params import SamplingParams
from ..errors import EngineBusyError, UnsupportedOperationError

T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine, self.core, self.frontend = engine, engine.core, engine.frontend
        self._lock = threading.Lock()          # the engine is not thread-safe: one caller at a time
        self._encode_lock = threading.Lock()   # prompts are encoded one at a time, off the event loop
        self._wake = threading.Event()
        self._aborts: list[str] = []           # request ids to abort, applied by the engine thread
        self._aborts_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="invariant-infer-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            with self._lock:
                self._apply_aborts()
                if not self.core.has_unfinished():
                    self._wake.clear()
                    continue
                try:
                    deltas = self.core.step_deltas()
                except Exception as exc:  # noqa: BLE001  (the loop must survive; fail what is in flight)
                    deltas = []
                    for rid in list(self._streams):
                        self.core.abort(rid)
                        deltas.append(end_delta(rid, "error", f"{type(exc).__name__}: {exc}"))
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    loop, queue = stream
                    loop.call_soon_threadsafe(queue.put_nowait, delta)

    def _apply_aborts(self) -> None:
        with self._aborts_lock:
            aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.core.abort(request_id)

    def _abort_later(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        with self._aborts_lock:
            self._aborts.append(request_id)
        self._wake.set()

    def _add(self, prompt, params, request_id, loop, queue, lora=None,
             prompt_inputs=None) -> tuple[str, int, list[int]]:
        """(request id, seed, prompt ids): the prompt is tokenized before the engine's lock is taken; a
        prompt with images (``Engine.split_prompt``'s form) has its images encoded under the lock (the
        vision tower is the model's)."""
        images = None
        if isinstance(prompt, (str, dict)):
            with self._encode_lock:
                prompt_ids, images = self.frontend.split_prompt(prompt)
        else:
            prompt_ids = self.frontend.encode(prompt)
        with self._lock:
            if images:
                prompt_ids, prompt_inputs = self.frontend.prepare_images(prompt_ids, images)
            request_id, seed = self.core.add_token_request(prompt_ids, params, request_id, lora=lora,
                                                           prompt_inputs=prompt_inputs)
            self._streams[request_id] = (loop, queue)
        return request_id, seed, prompt_ids

    def prepare_images(self, prompt_ids: list[int], images) -> tuple[list[int], object]:
        """``Engine.prepare_images`` under the engine's lock (the vision tower is the model's), from any thread."""
        with self._lock:
            return self.frontend.prepare_images(prompt_ids, images)

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       lora: str | None = None, prompt_inputs=None) -> AsyncIterator[RequestOutput]:
        """Add a request (on adapter ``lora``; ``RequestError`` for a bad one) and yield its outputs (of its
        ``output_kind``) until it finishes. ``prompt``: text, token ids, or with images ``Engine.split_prompt``'s
        form (or its expanded ids with ``prompt_inputs``, what ``prepare_images`` made of them). Leaving the
        iteration early (a client that went away) aborts it and frees its pages."""
        params = params or SamplingParams()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        adding = loop.run_in_executor(None, self._add, prompt, params, request_id, loop, queue, lora, prompt_inputs)
        try:
            request_id, seed, prompt_ids = await asyncio.shield(adding)
        except asyncio.CancelledError:  # the caller left while the request was being added
            adding.add_done_callback(lambda f: f.cancelled() or f.exception() or self._abort_later(f.result()[0]))
            raise
        self._wake.set()
        processor = self.frontend.output_processor(request_id, prompt_ids, params, seed)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                out, stopped = processor.process(delta)
                if stopped:  # a stop string ended it: the core stops it before its next step
                    self._abort_later(request_id)
                finished = processor.finished
                if out is not None:
                    yield out
        finally:
            if finished:
                self._streams.pop(request_id, None)
            else:
                self._abort_later(request_id)

    def locked(self, call: Callable[[Engine], T]) -> T:
        """``call(engine)`` between steps (e.g. ``add_lora``); blocks up to one step: call it off the event loop."""
        with self._lock:
            self._apply_aborts()
            return call(self.engine)

    def reset_prefix_cache(self) -> int:
        """``Engine.reset_prefix_cache`` between steps (``EngineBusyError`` while requests are in flight)."""
        with self._lock:
            self._apply_aborts()
            return self.core.reset_prefix_cache()

    def update_weights(self, update: Callable[[object], T]) -> T:
        """Run ``update(model)`` (in-place changes of its weights) while no step runs, then reset
        the prefix cache, also if ``update`` raises (its copy may have stopped halfway). With
        requests in flight, raises ``EngineBusyError`` and runs nothing. Blocks up to one step:
        call it off the event loop."""
        if self.core.tensor_parallel_size > 1:
            raise UnsupportedOperationError("weight updates are not supported under tensor parallelism (the other "
                                            "ranks hold their own shards)")
        with self._lock:
            self._apply_aborts()
            if self.core.has_unfinished():
                raise EngineBusyError(f"cannot update the weights with {len(self.core.sequences)} requests in the "
                                      "engine")
            try:
                return update(self.core.model)
            finally:
                self.core.reset_prefix_cache()

    def stats(self) -> dict:
        with self._lock:
            scheduler, blocks = self.core.scheduler, self.core.blocks
            stats = {"waiting": len(scheduler.waiting), "running": len(scheduler.running),
                     "kv_pages_used": blocks.num_used, "kv_pages_total": blocks.num_pages}
            if self.core.speculative is not None:
                spec = self.core.speculative.stats
                stats.update(spec_decode_num_drafts=spec.num_drafts,
                             spec_decode_num_draft_tokens=spec.num_draft_tokens,
                             spec_decode_num_accepted_tokens=spec.num_accepted_tokens)
            return stats

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
