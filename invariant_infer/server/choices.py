"""Running a response's choices on the ``AsyncEngine``, shared by completions and chat: admission
(429 past capacity, 503 while paused), each choice one engine request, the whole response with its usage envelope
or the event stream, and the abort of every choice when the client goes away.

Each choice is one engine request and the engine makes each request's tokens and logprobs a
function of that request alone, so a response never depends on the traffic it ran among."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from ..engine import AsyncEngine, RequestOutput
from .errors import JSON, APIError
from .formats import Choice
from .metrics import Metrics
from .streaming import EventStream

DISCONNECT_POLL_S = 0.25
FINGERPRINT = "invariant-infer"


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """Choice ``i`` of a request with ``seed`` uses ``seed + i``; without one each draws a seed
    (returned with the choice, so it can be replayed)."""
    return [seed + i for i in range(n)] if seed is not None else [secrets.randbits(63) for _ in range(n)]


def failure(out) -> str | None:
    """Why a choice failed (an exception or an engine output that errored or was aborted), else None."""
    if isinstance(out, BaseException):
        return f"{type(out).__name__}: {out}"
    if out is None:
        return "no output"
    if out.error or out.finish_reason in ("error", "abort"):
        return out.error or out.finish_reason
    return None


class ChoiceRunner:
    def __init__(self, async_engine: AsyncEngine, metrics: Metrics, model_name: str, capacity: int,
                 stream_write_timeout: float):
        self.async_engine, self.metrics, self.model_name = async_engine, metrics, model_name
        self.capacity, self.stream_write_timeout = capacity, stream_write_timeout
        self.in_flight = 0
        self.paused: str | None = None  # why new requests are refused (503), e.g. a weight update

    def admit(self, count: int) -> None:
        if self.paused is not None:
            raise APIError(503, self.paused, code="weights_updating", headers={"Retry-After": "1"})
        if self.in_flight and self.in_flight + count > self.capacity:
            raise APIError(429, f"the server's queue is full ({self.in_flight} sequences in flight); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.in_flight += count
        self.metrics.in_flight.set(self.in_flight)

    def release(self, count: int) -> None:
        self.in_flight -= count
        self.metrics.in_flight.set(self.in_flight)

    async def respond(self, request: Request, rid: str, choices: list[Choice], fmt, stream: bool,
                      prompt_tokens: int) -> Response:
        """Admit the choices and run them: the whole response, or its event stream."""
        self.admit(len(choices))
        self.metrics.prompt.inc(prompt_tokens)
        if stream:
            released = []

            def release_once():
                if not released:
                    released.append(True)
                    self.release(len(choices))
            return EventStream(self.events(rid, choices, fmt), write_timeout=self.stream_write_timeout,
                               on_close=release_once)
        try:
            outputs = await self.gather(request, choices)
        finally:
            self.release(len(choices))
        for out in outputs:
            if (why := failure(out)) is not None:
                raise APIError(500, f"the request failed in the engine: {why}", code="engine_error")
            self.metrics.tokens_done(len(out.token_ids))
        completion_tokens = sum(len(out.token_ids) for out in outputs)
        return JSON({"id": rid, "object": fmt.object, "created": int(time.time()), "model": self.model_name,
                     "choices": [fmt.whole(k, out) for k, out in enumerate(outputs)],
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens},
                     "system_fingerprint": FINGERPRINT})

    async def outputs(self, choices: list[Choice]) -> AsyncIterator[tuple[int, RequestOutput | Exception]]:
        """``(k, output)`` as choice ``k`` advances, all choices interleaved, until each finishes; an
        exception in place of an output ends that choice. Closing the iterator early aborts them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, choice: Choice) -> None:
            try:
                async for out in self.async_engine.generate(choice.prompt_ids, choice.params, choice.request_id,
                                                             lora=choice.lora, prompt_inputs=choice.prompt_inputs):
                    queue.put_nowait((k, out))
            except Exception as exc:  # noqa: BLE001  (reported in place of the choice's output)
                queue.put_nowait((k, exc))
            finally:
                queue.put_nowait((k, None))

        tasks = [asyncio.create_task(pump(k, c)) for k, c in enumerate(choices)]
        remaining = len(tasks)
        try:
            while remaining:
                k, out = await queue.get()
                if out is None:
                    remaining -= 1
                else:
                    yield k, out
        finally:
            # No await here: a cancelled stream (the client went away) is cancelled again at every
            # await. Each cancelled task aborts its engine request, freeing its pages.
            for task in tasks:
                task.cancel()

    async def gather(self, request: Request, choices: list[Choice]) -> list:
        """Each choice's last output (FINAL_ONLY: its only one); a client that disconnects cancels (aborts) them
        all."""
        last: list = [None] * len(choices)

        async def consume() -> None:
            stream = self.outputs(choices)
            try:
                async for k, out in stream:
                    last[k] = out
            finally:
                await stream.aclose()

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    raise asyncio.CancelledError("client disconnected")
            task.result()
            return last
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def events(self, rid: str, choices: list[Choice], fmt) -> AsyncIterator[str]:
        """The event stream: the format's opening pieces, one event per engine output (a DELTA), an error
        event if a choice fails, then ``data: [DONE]``."""
        created = int(time.time())

        def event(piece: dict) -> str:
            return "data: " + json.dumps({"id": rid, "object": fmt.chunk_object, "created": created,
                                          "model": self.model_name, "choices": [piece]}) + "\n\n"
        for piece in fmt.opening():
            yield event(piece)
        stream = self.outputs(choices)
        generated = [0] * len(choices)  # tokens of each choice so far (each output holds its new ones)
        try:
            async for k, out in stream:
                if (why := failure(out)) is not None:
                    yield "data: " + json.dumps(APIError(500, f"the request failed: {why}",
                                                         code="engine_error").body()) + "\n\n"
                    break
                generated[k] += len(out.token_ids)
                if out.finished:
                    self.metrics.tokens_done(generated[k])
                yield event(fmt.piece(k, out))
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # no suspension: the choices' tasks are cancelled synchronously
