"""``invariant-infer serve``: an OpenAI-compatible HTTP server over the engine (needs the ``serve``
extra: fastapi, uvicorn, prometheus-client).

Files: ``protocol`` (the request bodies, pydantic), ``errors`` (OpenAI's error body and the
handlers), ``formats`` (engine outputs in OpenAI's shapes), ``choices`` (running a response's
choices, whole or streamed), ``streaming`` (server-sent events with a write timeout), ``metrics``
(Prometheus), ``state``, ``routes``, ``app`` (``create_app``) and ``main`` (load a checkpoint and
run uvicorn). A pooled checkpoint's app: ``pooling_protocol``, ``pooling_state``, ``pooling_routes``
(vLLM's embeddings, score, rerank, classify and pooling routes) and ``pooling_app``."""
from .app import create_app
from .state import ServerOptions

__all__ = ["create_app", "ServerOptions"]
