"""The endpoints: OpenAI completions and chat completions, models, health, metrics, the
tokenizer endpoints lm-eval's remote tokenizer uses, and SGLang's ``/update_weights_from_disk``.
Bodies arrive parsed (``protocol``); every refusal is raised and answered by a handler in ``errors``."""
from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from .choices import choice_seeds
from .errors import JSON, APIError, bad
from .formats import ChatFormat, Choice, CompletionFormat
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       UpdateWeightsFromDiskRequest)
from .state import ServerState

bearer = HTTPBearer(auto_error=False)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def authorized(server: ServerState = Depends(server_state),
               credentials: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """With an API key, ``Authorization: Bearer KEY`` (checked before the body's fields)."""
    key = server.options.api_key
    if key is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not secrets.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")


api = APIRouter(dependencies=[Depends(authorized)])
public = APIRouter()


@api.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, server: ServerState = Depends(server_state)):
    lora = server.check_model(body.model)
    encoded = [server.encode(p) for p in body.prompt]
    prompt_logprobs = body.logprobs if body.echo else None
    rid = f"cmpl-{secrets.token_hex(12)}"
    choices = []
    for p, ids in enumerate(encoded):  # choices of prompt p are indices p*n .. p*n+n-1
        for i, seed in enumerate(choice_seeds(body.seed, body.n)):
            params = body.params(body.max_tokens, seed, body.logprobs, prompt_logprobs)
            server.check_request(ids, params)
            index = p * body.n + i
            choices.append(Choice(index, p, ids, params, f"{rid}-{index}", lora))
    prompt_texts = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in body.prompt] \
        if body.echo else None
    fmt = CompletionFormat(server.tokens, choices, prompt_texts, body.echo, body.logprobs)
    return await server.runner.respond(request, rid, choices, fmt, body.stream, sum(map(len, encoded)))


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           server: ServerState = Depends(server_state)):
    lora = server.check_model(body.model)
    ids = server.encode(server.chat_prompt(body.messages), param="messages")
    images = [image for message in body.messages for image in message.images()]
    prompt_inputs = None
    if images:  # processed and encoded once for all choices, off the event loop
        ids, prompt_inputs = await run_in_threadpool(server.async_engine.prepare_images, ids, images)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, server.engine.max_positions - len(ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = f"chatcmpl-{secrets.token_hex(12)}"
    choices = []
    for i, seed in enumerate(choice_seeds(body.seed, body.n)):
        params = body.params(max_tokens, seed, logprobs)
        server.check_request(ids, params)
        choices.append(Choice(i, 0, ids, params, f"{rid}-{i}", lora, prompt_inputs))
    fmt = ChatFormat(server.tokens, choices, body.logprobs)
    return await server.runner.respond(request, rid, choices, fmt, body.stream, len(ids))


@api.get("/v1/models")
async def models(server: ServerState = Depends(server_state)):
    return JSON({"object": "list", "data": [{"id": server.options.model_name, "object": "model", "created": 0,
                                             "owned_by": "invariant-infer",
                                             "max_model_len": server.engine.max_positions}] + server.adapter_cards()})


@api.get("/tokenizer_info")
async def tokenizer_info(server: ServerState = Depends(server_state)):
    t = server.tokenizer
    return JSON({"eos_token": t.eos_token, "bos_token": t.bos_token, "pad_token": t.pad_token,
                 "chat_template": getattr(t, "chat_template", None),
                 "model_max_length": server.engine.max_positions, "vocab_size": server.engine.vocab_size})


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, server: ServerState = Depends(server_state)):
    if body.prompt is not None:
        text = body.prompt
    elif body.messages is not None:
        text = server.chat_prompt(body.messages, body.add_generation_prompt)
    else:
        raise bad("'prompt' (a string) or 'messages' is required", "prompt", "missing_required_parameter")
    tokens = server.encode(text, body.add_special_tokens, "prompt" if body.prompt is not None else "messages")
    return JSON({"tokens": tokens, "count": len(tokens), "max_model_len": server.engine.max_positions})


@api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, server: ServerState = Depends(server_state)):
    if not all(0 <= t < len(server.tokenizer) for t in body.tokens):
        raise bad("'tokens' must be token ids in the tokenizer's vocabulary", "tokens")
    return JSON({"prompt": server.tokenizer.decode(body.tokens)})


@api.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, server: ServerState = Depends(server_state)):
    """New weights from a checkpoint directory, between requests (``weights`` says how)."""
    return JSON(await server.weights.update_from_disk(body.model_path, body.timeout))


@public.get("/health")
async def health():
    return JSON({"status": "ok"})


@public.get("/metrics")
async def metrics(server: ServerState = Depends(server_state)):
    # off the event loop: reading the engine's stats waits for its lock, up to one step
    return Response(await run_in_threadpool(server.metrics.render), media_type=server.metrics.content_type)
