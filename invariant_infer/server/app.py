"""The FastAPI app over an ``AsyncEngine``: the routes, the error handlers, the body-size limit
and the request metrics. Shutting the app down shuts the engine down."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import AsyncEngine
from .errors import APIError, error_response, install_handlers
from .metrics import RequestMetrics
from .lora import lora_api
from .pooling_routes import pooling_refusals
from .routes import api, public
from .state import ServerOptions, ServerState


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets OpenAI's 413 body, at once when
    its Content-Length says so, else when the bytes read pass it. (FastAPI's own ``max_body_size``
    answers a declared oversize body with Starlette's plain-text 413, whatever the handlers say.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body over {self.limit} bytes"
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await error_response(APIError(413, too_large, code="request_too_large"))(scope, receive, send)
        size = 0

        async def counting_receive():
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.limit:  # an HTTPException, so FastAPI's body reading lets it through
                raise StarletteHTTPException(413, too_large)
            return message
        await self.app(scope, counting_receive, send)


def create_app(async_engine: AsyncEngine, tokenizer, options: ServerOptions | None = None) -> FastAPI:
    """The app for an engine (with its tokenizer)."""
    options = options or ServerOptions()
    server = ServerState(async_engine, tokenizer, options)
    # pooling_refusals: 400s naming the task on the pooling routes
    return build_app(server, options, async_engine.shutdown, (api, lora_api, pooling_refusals, public))


def build_app(server, options: ServerOptions, shutdown, routers) -> FastAPI:
    """The FastAPI app both servers run: ``server`` as its state, the error handlers, the body limit and
    the request metrics (outermost: they count the 413s too), ``routers`` in order, ``shutdown`` on exit."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        shutdown()

    app = FastAPI(title="invariant-infer", lifespan=lifespan)
    app.state.server = server
    install_handlers(app)
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=server.metrics)
    for router in routers:
        app.include_router(router)
    return app
