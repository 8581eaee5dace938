"""``invariant-infer serve``: an OpenAI-compatible HTTP server over the engine (needs the ``serve``
extra: fastapi, uvicorn, prometheus-client). ``app`` builds the FastAPI app from an ``AsyncEngine``;
``protocol`` checks requests; ``main`` loads a checkpoint and runs uvicorn."""
from __future__ import annotations

__all__ = ["create_app", "ServerOptions"]


def __getattr__(name):
    if name in __all__:
        from . import app
        return getattr(app, name)
    raise AttributeError(name)
