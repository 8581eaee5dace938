"""The pooling endpoints, vLLM's: ``/v1/embeddings``, ``/score`` (and ``/v1/score``), ``/rerank`` (and
``/v1/rerank``), ``/classify`` and ``/pooling``; and the refusals, naming the task, of the routes the
other kind of server serves. Each input is one row of the batching engine (``engine.pooling_engine``),
so every value is bitwise what the input gives alone. Embeddings and logits are float32 and written as
JSON floats (exact round trip); probabilities and scores are float64."""
from __future__ import annotations

import base64
import math
import secrets
import time

import torch
from fastapi import APIRouter, Depends, Request

from .errors import JSON, bad
from .pooling_protocol import (ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest,
                               ScoreRequest)
from .pooling_state import POOLING_ROUTES, TASK_ROUTES, PoolingServerState
from .routes import authorized, server_state

pooling_api = APIRouter(dependencies=[Depends(authorized)])
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                     "/update_weights_from_disk", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _usage(inputs: list) -> dict:
    tokens = sum(len(i.input_ids) for i in inputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _opening(server: PoolingServerState, prefix: str) -> dict:
    return {"id": f"{prefix}-{secrets.token_hex(12)}", "object": "list", "created": int(time.time()),
            "model": server.options.model_name}


def _encoded(row: torch.Tensor, encoding_format: str):
    """A float32 row as JSON floats, or base64 of its little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(row.numpy().astype("<f4").tobytes()).decode()
    return row.tolist()


@pooling_api.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, server: PoolingServerState = Depends(server_state)):
    server.check_model(body.model)
    server.require("/v1/embeddings")
    inputs = [server.encode(item, f"input[{i}]") for i, item in enumerate(body.input)]
    rows = (await server.embeddings(inputs, body.dimensions)).float()
    data = [{"object": "embedding", "index": i, "embedding": _encoded(row, body.encoding_format)}
            for i, row in enumerate(rows)]
    return JSON({**_opening(server, "embd"), "data": data, "usage": _usage(inputs)})


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity in float64, exactly rounded sums (products of float32 values are exact)."""
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(x * x for x in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms else 0.0


async def pair_scores(server: PoolingServerState, pairs: list[tuple[str, str]], param: str):
    """The score of each (text_1, text_2) pair, and the inputs run: a cross-encoder's head activation
    (sigmoid of its one logit), or the cosine of an embedder's two embeddings."""
    if server.task == "score":
        inputs = [server.encode_pair(a, b, f"{param}[{i}]") for i, (a, b) in enumerate(pairs)]
        activations = server.model.activations(await server.run(inputs))
        if activations.shape[1] != 1:
            raise bad(f"'{server.options.model_name}' has {activations.shape[1]} labels: pair scores need a "
                      "cross-encoder with one (use /classify)")
        return activations[:, 0].tolist(), inputs
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each text embedded once
    inputs = [server.encode(t, param) for t in texts]
    rows = (await server.embeddings(inputs)).float().tolist()
    row_of = dict(zip(texts, rows))
    return [cosine(row_of[a], row_of[b]) for a, b in pairs], inputs


async def _score(body: ScoreRequest, server: PoolingServerState, route: str):
    server.check_model(body.model)
    server.require(route)
    t1, t2 = body.text_1, body.text_2
    if len(t1) == 1:
        pairs = [(t1[0], b) for b in t2]
    elif len(t1) == len(t2):
        pairs = list(zip(t1, t2))
    else:
        raise bad(f"'text_1' has {len(t1)} texts and 'text_2' {len(t2)}: give one text_1 (scored against each "
                  "text_2) or as many as text_2 (scored pairwise)", "text_1")
    scores, inputs = await pair_scores(server, pairs, "text_2")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSON({**_opening(server, "score"), "data": data, "usage": _usage(inputs)})


@pooling_api.post("/score")
@pooling_api.post("/v1/score")
async def score(body: ScoreRequest, request: Request, server: PoolingServerState = Depends(server_state)):
    return await _score(body, server, request.scope["route"].path)


async def _rerank(body: RerankRequest, server: PoolingServerState, route: str):
    server.check_model(body.model)
    server.require(route)
    scores, inputs = await pair_scores(server, [(body.query, d) for d in body.documents], "documents")
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if body.top_n:
        order = order[:body.top_n]
    results = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]} for i in order]
    opening = _opening(server, "rerank")
    return JSON({"id": opening["id"], "model": opening["model"], "usage": _usage(inputs), "results": results})


@pooling_api.post("/rerank")
@pooling_api.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request, server: PoolingServerState = Depends(server_state)):
    return await _rerank(body, server, request.scope["route"].path)


@pooling_api.post("/classify")
async def classify(body: ClassificationRequest, server: PoolingServerState = Depends(server_state)):
    server.check_model(body.model)
    server.require("/classify")
    inputs = [server.encode(item, f"input[{i}]") for i, item in enumerate(body.input)]
    probs = server.model.activations(await server.run(inputs))
    labels = server.model.labels
    data = []
    for i, row in enumerate(probs):
        best = int(torch.argmax(row))
        data.append({"index": i, "label": labels[best] if labels else str(best), "probs": row.tolist(),
                     "num_classes": row.shape[0]})
    return JSON({**_opening(server, "classify"), "data": data, "usage": _usage(inputs)})


@pooling_api.post("/pooling")
async def pooling(body: PoolingRequest, server: PoolingServerState = Depends(server_state)):
    """Each input's raw output: an embedder's embedding (as /v1/embeddings gives it), a head's logits."""
    server.check_model(body.model)
    inputs = [server.encode(item, f"input[{i}]") for i, item in enumerate(body.input)]
    rows = await (server.embeddings(inputs) if server.task == "embed" else server.run(inputs))
    data = [{"index": i, "object": "pooling", "data": _encoded(row.float(), body.encoding_format)}
            for i, row in enumerate(rows)]
    return JSON({**_opening(server, "pool"), "data": data, "usage": _usage(inputs)})


@pooling_api.get("/v1/models")
async def models(server: PoolingServerState = Depends(server_state)):
    return JSON({"object": "list", "data": [server.card()]})


def refusals(paths: tuple[str, ...], message) -> APIRouter:
    """POST ``paths`` answered by a 400 ``message(server, path)`` (after the API key)."""
    router = APIRouter(dependencies=[Depends(authorized)])
    for path in paths:
        def refuse(server=Depends(server_state), path=path):
            raise bad(message(server, path), code="unsupported_task")
        router.add_api_route(path, refuse, methods=["POST"])
    return router


def _generation_route_on_pooled(server, path: str) -> str:
    return (f"{path} needs a generation model; this server serves '{server.options.model_name}' for task "
            f"'{server.task}' (routes: {', '.join(TASK_ROUTES[server.task])})")


def _pooling_route_on_generation(server, path: str) -> str:
    return (f"{path} needs a pooled model (task embed, score, classify or reward); this server serves "
            f"'{server.options.model_name}' for task 'generate'")


generation_refusals = refusals(GENERATION_ROUTES, _generation_route_on_pooled)  # on a pooled server
pooling_refusals = refusals(POOLING_ROUTES, _pooling_route_on_generation)      # on a generation server
