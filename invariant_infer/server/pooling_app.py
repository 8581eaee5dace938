"""The FastAPI app of a pooled checkpoint (embedder, cross-encoder, classifier, reward model) over its
batching engine, with the generation server's error handlers, body limit, API key and request
metrics; generation routes answer a 400 naming the task. And the check it runs before taking
traffic: rows alone against the same rows in padded batches, bitwise."""
from __future__ import annotations

import sys

import torch
from fastapi import FastAPI

from ..engine.pooling_engine import PoolingEngine
from .app import build_app
from .pooling_routes import generation_refusals, pooling_api
from .pooling_state import PoolingServerState
from .routes import public
from .state import ServerOptions

CHECK_TEXTS = ("a", "the quick brown fox jumps over the lazy dog", "hello world, " * 3)


def create_pooling_app(engine: PoolingEngine, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    server = PoolingServerState(engine, options)
    # public: /health, /metrics (``PoolingMetrics.render``)
    return build_app(server, options, engine.shutdown, (pooling_api, generation_refusals, public))


def check_pooled_rows(model) -> list[tuple[str, bool]]:
    """(what, passed) of each probe: a few rows alone, together, and together in reverse order."""
    rows = [model.tokenize(t) for t in CHECK_TEXTS]
    rows = [r for r in rows if 0 < len(r.input_ids) <= model.max_length]
    alone = torch.cat([model.forward_rows([r]) for r in rows])
    together = model.forward_rows(rows)
    reverse = model.forward_rows(rows[::-1]).flip(0)
    return [(f"{len(rows)} rows alone == the rows in one padded batch", torch.equal(alone, together)),
            ("the same batch in reverse order", torch.equal(alone, reverse))]


def passes_pooling_check(model, options: ServerOptions) -> bool:
    """Run the check, one line per probe on stderr; True when every probe passes (or on the stock kernels)."""
    if options.kernels != "invariant":
        print("invariant-infer serve: check: not run on the stock kernels (the batch-variant baseline)",
              file=sys.stderr, flush=True)
        return True
    results = check_pooled_rows(model)
    for what, ok in results:
        print(f"invariant-infer serve: check: {'PASS' if ok else 'FAIL'}  {what}", file=sys.stderr, flush=True)
    failed = [what for what, ok in results if not ok]
    if failed:
        print(f"invariant-infer serve: not batch-invariant here ({'; '.join(failed)}): not serving "
              "(--skip-check serves without the check)", file=sys.stderr, flush=True)
    return not failed
