"""Server-sent events over Starlette's ``StreamingResponse``, with a write timeout.

uvicorn's ``send`` waits while the connection's write buffer is full, so a client that stops
reading would hold its engine requests (and their KV pages) until they finish. Here a send that
waits longer than ``write_timeout`` ends the response: the event source is closed at once, which
aborts its engine requests, and uvicorn closes the connection."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse

log = logging.getLogger("invariant_infer.server")


class StreamStalled(Exception):
    """The client read nothing for ``write_timeout`` seconds."""


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], *, write_timeout: float, on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self.events, self.write_timeout, self.on_close = events, write_timeout, on_close

    async def stream_response(self, send) -> None:
        async def send_in_time(message) -> None:
            try:
                with anyio.fail_after(self.write_timeout):
                    await send(message)
            except TimeoutError:
                raise StreamStalled from None
        await super().stream_response(send_in_time)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except StreamStalled:
            log.warning("a stream's client read nothing for %s s: stream ended, its requests aborted",
                        self.write_timeout)
        finally:
            self.on_close()  # before any await: a cancelled caller is cancelled again at each await
            await self.events.aclose()
