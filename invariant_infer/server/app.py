"""The FastAPI app: OpenAI completions and chat completions over an ``AsyncEngine``.

Every choice is one engine request, and the engine makes each request's tokens and logprobs a
function of that request alone, so a response never depends on the traffic it ran among. Choice
``i`` of a request with ``seed`` uses ``seed + i`` (returned as ``choices[i].seed``; without a seed
each choice draws one and returns it): it equals the same request sent alone with ``n = 1`` and
that seed.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import weakref
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import AsyncEngine, RequestError, SamplingParams
from .protocol import (MAX_LOGPROBS, SAMPLING_FIELDS, APIError, bad, check_fields, get_bool, get_int,
                       parse_messages, parse_prompts, parse_sampling)

COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


@dataclass
class ServerOptions:
    model_name: str = "model"
    api_key: str | None = None
    max_waiting: int = 256               # sequences queued beyond max_num_seqs before 429
    max_body_bytes: int = 16 << 20
    default_max_tokens: int = 16         # completions without max_tokens (OpenAI's default)


class JSON(JSONResponse):
    """Logprobs are float32 values written as Python floats: repr round-trips them exactly.
    A -inf logprob is written as -Infinity (Python's json reads it)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()


def error_response(exc: APIError) -> JSONResponse:
    return JSON(exc.body(), status_code=exc.status, headers=exc.headers)


class Metrics:
    def __init__(self, async_engine: AsyncEngine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.async_engine = async_engine
        self.queue = Gauge("invariant_infer_queue_length", "Sequences waiting for a slot", registry=registry)
        self.running = Gauge("invariant_infer_running_sequences", "Sequences in the running batch", registry=registry)
        self.pages_used = Gauge("invariant_infer_kv_pages_used", "KV cache pages in use", registry=registry)
        self.pages_total = Gauge("invariant_infer_kv_pages_total", "KV cache pages in all", registry=registry)
        self.in_flight = Gauge("invariant_infer_requests_in_flight", "Engine requests admitted by the server",
                               registry=registry)
        self.tokens_per_s = Gauge("invariant_infer_generation_tokens_per_second",
                                  "Generated tokens per second over the last 10 s", registry=registry)
        self.generated = Counter("invariant_infer_generation_tokens", "Generated tokens", registry=registry)
        self.prompt = Counter("invariant_infer_prompt_tokens", "Prompt tokens", registry=registry)
        self.requests = Counter("invariant_infer_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.latency = Histogram("invariant_infer_request_latency_seconds", "Request latency", ["endpoint"],
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                 registry=registry)
        self._window: deque[tuple[float, int]] = deque()

    def tokens_done(self, count: int) -> None:
        self.generated.inc(count)
        self._window.append((time.monotonic(), count))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        stats = self.async_engine.stats()
        self.queue.set(stats["waiting"])
        self.running.set(stats["running"])
        self.pages_used.set(stats["kv_pages_used"])
        self.pages_total.set(stats["kv_pages_total"])
        now = time.monotonic()
        while self._window and self._window[0][0] < now - 10:
            self._window.popleft()
        self.tokens_per_s.set(sum(c for _, c in self._window) / 10)
        return generate_latest(self.registry)


class Server:
    def __init__(self, async_engine: AsyncEngine, tokenizer, options: ServerOptions):
        self.async_engine, self.engine, self.tokenizer = async_engine, async_engine.engine, tokenizer
        self.options = options
        self.metrics = Metrics(async_engine)
        self.in_flight = 0
        self.capacity = self.engine.scheduler.max_num_seqs + options.max_waiting
        self.token_string = lru_cache(maxsize=1 << 16)(self._token_string)

    # ---- helpers -----------------------------------------------------------------------------------

    def _token_string(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def check_auth(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.options.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.options.model_name:
            raise APIError(404, f"the model '{model}' does not exist (this server serves "
                           f"'{self.options.model_name}')", param="model", code="model_not_found")

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return prompt

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        total = len(ids) + params.max_tokens
        if ids and total > self.engine.max_positions:
            raise bad(f"this model's context length is {self.engine.max_positions} tokens; the prompt has "
                      f"{len(ids)} and max_tokens is {params.max_tokens} ({total} in all)", "max_tokens",
                      "context_length_exceeded")
        try:
            self.engine.check_request(ids, params)
        except RequestError as exc:
            message = str(exc)
            raise bad(message, "prompt" if "prompt" in message or "vocabulary" in message else None) from None

    def admit(self, count: int) -> None:
        if self.in_flight and self.in_flight + count > self.capacity:
            raise APIError(429, f"the server's queue is full ({self.in_flight} sequences in flight); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.in_flight += count
        self.metrics.in_flight.set(self.in_flight)

    def release(self, count: int) -> None:
        self.in_flight -= count
        self.metrics.in_flight.set(self.in_flight)

    def choice_seeds(self, seed: int | None, n: int) -> list[int]:
        if seed is not None:
            return [seed + i for i in range(n)]
        return [secrets.randbits(63) for _ in range(n)]

    async def run_to_end(self, ids, params, request_id):
        last = None
        async for out in self.async_engine.generate(ids, params, request_id):
            last = out
        return last

    async def gather(self, request: Request, jobs) -> list:
        """Run engine requests to the end; a client that disconnects cancels (aborts) all of them."""
        tasks = [asyncio.create_task(self.run_to_end(*job)) for job in jobs]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.2)
                if not pending:
                    break
                if await request.is_disconnected():
                    raise asyncio.CancelledError("client disconnected")
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- logprobs in the completions format ---------------------------------------------------------

    def _top(self, top: dict[int, float] | None, own_id: int, own: float) -> dict[str, float]:
        """Alternatives keyed by token string, always with the chosen token; where two ids read the
        same, the higher logprob is kept."""
        merged: dict[str, float] = {}
        for token_id, value in list((top or {}).items()) + [(own_id, own)]:
            key = self.token_string(token_id)
            if key not in merged or value > merged[key]:
                merged[key] = value
        return merged

    def _offsets(self, ids: list[int], base: int, skip_special: bool) -> list[int]:
        decode = self.tokenizer.decode
        return [base + len(decode(ids[:i], skip_special_tokens=skip_special)) for i in range(len(ids))]

    def completion_logprobs(self, out, prompt_part: bool, generated_from: int, text_base: int,
                            prompt_text_len: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        if prompt_part:
            prompt = out.prompt_token_ids
            tokens += [self.token_string(t) for t in prompt]
            values += [None] + list(out.prompt_logprobs)
            prompt_tops = out.prompt_top_logprobs or [None] * len(out.prompt_logprobs)
            tops += [None] + [self._top(top, prompt[i + 1], value)
                              for i, (top, value) in enumerate(zip(prompt_tops, out.prompt_logprobs))]
            offsets += [min(o, prompt_text_len) for o in self._offsets(prompt, 0, False)]
        ids = out.token_ids
        gen_tops = out.top_logprobs or [None] * len(ids)
        all_offsets = self._offsets(ids, 0, True)
        for j in range(generated_from, len(ids)):
            tokens.append(self.token_string(ids[j]))
            values.append(out.logprobs[j])
            tops.append(self._top(gen_tops[j], ids[j], out.logprobs[j]))
            offsets.append(text_base + min(all_offsets[j], len(out.text or "")))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, out, generated_from: int) -> list[dict]:
        content = []
        gen_tops = out.top_logprobs or [None] * len(out.token_ids)
        for j in range(generated_from, len(out.token_ids)):
            token = self.token_string(out.token_ids[j])
            content.append({"token": token, "logprob": out.logprobs[j], "bytes": list(token.encode()),
                            "top_logprobs": [{"token": self.token_string(t), "logprob": v,
                                              "bytes": list(self.token_string(t).encode())}
                                             for t, v in (gen_tops[j] or {}).items()]})
        return content

    # ---- endpoints --------------------------------------------------------------------------------

    async def completions(self, request: Request):
        self.check_auth(request)
        body = await self.read_json(request)
        self.check_model(body)
        check_fields(body, COMPLETION_FIELDS)
        if "prompt" not in body:
            raise bad("'prompt' is required", "prompt", "missing_required_parameter")
        prompts = parse_prompts(body["prompt"])
        sampling = parse_sampling(body, self.options.default_max_tokens)
        echo = get_bool(body, "echo", False)
        logprobs = get_int(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
        if sampling.max_tokens == 0 and not echo:
            raise bad("'max_tokens' must be >= 1 (0 is allowed with echo: prompt logprobs only)", "max_tokens")
        encoded = [self.encode(p) for p in prompts]
        seeds = self.choice_seeds(sampling.seed, sampling.n)
        jobs, meta = [], []
        rid = f"cmpl-{secrets.token_hex(12)}"
        for p, ids in enumerate(encoded):
            for i, seed in enumerate(seeds):
                params = self.sampling_params(sampling, seed, logprobs,
                                              logprobs if echo and logprobs is not None else None)
                self.check_request(ids, params)
                index = p * sampling.n + i
                jobs.append((ids, params, f"{rid}-{index}"))
                meta.append((index, p))
        prompt_texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if echo else None
        self.admit(len(jobs))
        released = False
        try:
            self.metrics.prompt.inc(sum(len(ids) for ids in encoded))
            if sampling.stream:
                released = True
                return self.streaming(self.stream_completions(request, jobs, meta, prompt_texts, echo, logprobs, rid,
                                                              max((len(s) for s in sampling.stop), default=0)),
                                      len(jobs))
            outputs = await self.gather(request, jobs)
        finally:
            if not released:
                self.release(len(jobs))
        choices = []
        for (index, p), out in zip(meta, outputs):
            self.raise_if_failed(out)
            self.metrics.tokens_done(len(out.token_ids))
            base = len(prompt_texts[p]) if echo else 0
            text = (prompt_texts[p] if echo else "") + (out.text or "")
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": out.finish_reason,
                      "seed": out.seed}
            if logprobs is not None:
                choice["logprobs"] = self.completion_logprobs(out, echo, 0, base, base)
            choices.append(choice)
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        prompt_tokens = sum(len(ids) for ids in encoded)
        return JSON({"id": rid, "object": "text_completion", "created": int(time.time()),
                     "model": self.options.model_name, "choices": choices,
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens},
                     "system_fingerprint": "invariant-infer"})

    def sampling_params(self, sampling, seed, logprobs, prompt_logprobs) -> SamplingParams:
        return SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                              top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, stop=list(sampling.stop),
                              repetition_penalty=sampling.repetition_penalty, ignore_eos=sampling.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def streaming(self, events, count: int) -> StreamingResponse:
        """An event stream holding ``count`` admitted sequences: they are released when the stream
        ends, is cancelled, or is dropped unstarted (a client gone before the first byte)."""
        released = []

        def release():
            if not released:
                released.append(True)
                self.release(count)

        async def wrapped():
            try:
                async for event in events:
                    yield event
            finally:
                release()  # before any await: a cancelled stream is cancelled again at each await
                await events.aclose()
        stream = wrapped()
        weakref.finalize(stream, release)
        return StreamingResponse(stream, media_type="text/event-stream")

    @staticmethod
    def raise_if_failed(out) -> None:
        if out is None or out.error or out.finish_reason in ("error", "abort"):
            detail = out.error if out is not None else "no output"
            raise APIError(500, f"the request failed in the engine: {detail}", code="engine_error")

    async def pump(self, jobs, queue: asyncio.Queue):
        async def one(k, job):
            try:
                async for out in self.async_engine.generate(*job):
                    await queue.put((k, out))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                await queue.put((k, exc))
            finally:
                queue.put_nowait((k, None))
        return [asyncio.create_task(one(k, job)) for k, job in enumerate(jobs)]

    @staticmethod
    def safe_text(out, hold: int) -> str:
        """Text that later tokens cannot change: all of it once finished; else less the last
        ``hold - 1`` characters (a stop string may be starting there) and a torn UTF-8 character."""
        text = out.text or ""
        if out.finished:
            return text
        if hold > 1:
            text = text[:max(0, len(text) - (hold - 1))]
        return text.rstrip("\ufffd")

    async def stream_completions(self, request, jobs, meta, prompt_texts, echo, logprobs, rid, hold):
        queue: asyncio.Queue = asyncio.Queue()
        tasks = await self.pump(jobs, queue)
        created = int(time.time())
        sent_text = [0] * len(jobs)
        sent_tokens = [0] * len(jobs)
        started = [False] * len(jobs)
        remaining = len(jobs)
        try:
            while remaining:
                k, out = await queue.get()
                if out is None:
                    remaining -= 1
                    continue
                index, p = meta[k]
                if isinstance(out, Exception) or out.error or out.finish_reason in ("error", "abort"):
                    message = str(out) if isinstance(out, Exception) else out.error
                    yield "data: " + json.dumps(APIError(500, f"the request failed: {message}",
                                                         code="engine_error").body()) + "\n\n"
                    break
                text = self.safe_text(out, hold)
                base = len(prompt_texts[p]) if echo else 0
                prefix = ""
                piece = {"index": index, "text": "", "logprobs": None, "finish_reason": None, "seed": out.seed}
                if logprobs is not None:
                    piece["logprobs"] = self.completion_logprobs(out, echo and not started[k], sent_tokens[k],
                                                                 base, base)
                if echo and not started[k]:
                    prefix = prompt_texts[p]
                started[k] = True
                sent_tokens[k] = len(out.token_ids)
                piece["text"] = prefix + text[sent_text[k]:]
                sent_text[k] = max(sent_text[k], len(text))
                if out.finished:
                    piece["finish_reason"] = out.finish_reason
                    self.metrics.tokens_done(len(out.token_ids))
                yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                             "model": self.options.model_name, "choices": [piece]}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # No await here: a cancelled stream (the client went away) is cancelled again at every
            # await. Each cancelled task aborts its engine request, freeing its pages.
            for t in tasks:
                if not t.done():
                    t.cancel()

    async def chat_completions(self, request: Request):
        self.check_auth(request)
        body = await self.read_json(request)
        self.check_model(body)
        check_fields(body, CHAT_FIELDS)
        if "messages" not in body:
            raise bad("'messages' is required", "messages", "missing_required_parameter")
        messages = parse_messages(body["messages"])
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad("the tokenizer has no chat template: use /v1/completions", "messages", "no_chat_template")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001  (a template that raises on these messages)
            raise bad(f"the chat template failed on these messages: {exc}", "messages") from None
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        sampling = parse_sampling(body, max(1, self.engine.max_positions - len(ids)), name)
        if sampling.max_tokens == 0:
            raise bad(f"'{name}' must be >= 1", name)
        want_logprobs = get_bool(body, "logprobs", False)
        top = get_int(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
        if top is not None and not want_logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want_logprobs else None
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        jobs = []
        for i, seed in enumerate(self.choice_seeds(sampling.seed, sampling.n)):
            params = self.sampling_params(sampling, seed, logprobs, None)
            self.check_request(ids, params)
            jobs.append((ids, params, f"{rid}-{i}"))
        self.admit(len(jobs))
        released = False
        try:
            self.metrics.prompt.inc(len(ids))
            if sampling.stream:
                released = True
                return self.streaming(self.stream_chat(jobs, want_logprobs, rid,
                                                       max((len(s) for s in sampling.stop), default=0)),
                                      len(jobs))
            outputs = await self.gather(request, jobs)
        finally:
            if not released:
                self.release(len(jobs))
        choices = []
        for i, out in enumerate(outputs):
            self.raise_if_failed(out)
            self.metrics.tokens_done(len(out.token_ids))
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text or ""},
                            "logprobs": {"content": self.chat_logprobs(out, 0)} if want_logprobs else None,
                            "finish_reason": out.finish_reason, "seed": out.seed})
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        return JSON({"id": rid, "object": "chat.completion", "created": int(time.time()),
                     "model": self.options.model_name, "choices": choices,
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                               "total_tokens": len(ids) + completion_tokens},
                     "system_fingerprint": "invariant-infer"})

    async def stream_chat(self, jobs, want_logprobs, rid, hold):
        queue: asyncio.Queue = asyncio.Queue()
        tasks = await self.pump(jobs, queue)
        created = int(time.time())
        sent_text, sent_tokens = [0] * len(jobs), [0] * len(jobs)
        remaining = len(jobs)

        def chunk(choice):
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                          "model": self.options.model_name, "choices": [choice]}) + "\n\n"
        try:
            for k in range(len(jobs)):
                yield chunk({"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            while remaining:
                k, out = await queue.get()
                if out is None:
                    remaining -= 1
                    continue
                if isinstance(out, Exception) or out.error or out.finish_reason in ("error", "abort"):
                    message = str(out) if isinstance(out, Exception) else out.error
                    yield "data: " + json.dumps(APIError(500, f"the request failed: {message}",
                                                         code="engine_error").body()) + "\n\n"
                    break
                text = self.safe_text(out, hold)
                choice = {"index": k, "delta": {"content": text[sent_text[k]:]},
                          "logprobs": {"content": self.chat_logprobs(out, sent_tokens[k])} if want_logprobs else None,
                          "finish_reason": out.finish_reason if out.finished else None, "seed": out.seed}
                sent_text[k] = max(sent_text[k], len(text))
                sent_tokens[k] = len(out.token_ids)
                if out.finished:
                    self.metrics.tokens_done(len(out.token_ids))
                yield chunk(choice)
            yield "data: [DONE]\n\n"
        finally:
            # No await here: a cancelled stream (the client went away) is cancelled again at every
            # await. Each cancelled task aborts its engine request, freeing its pages.
            for t in tasks:
                if not t.done():
                    t.cancel()


def create_app(async_engine: AsyncEngine, tokenizer, options: ServerOptions | None = None) -> FastAPI:
    """The app for an engine (with its tokenizer). Shutting the app down shuts the engine down."""
    from contextlib import asynccontextmanager

    options = options or ServerOptions()
    server = Server(async_engine, tokenizer, options)

    @asynccontextmanager
    async def lifespan(app):
        yield
        async_engine.shutdown()

    app = FastAPI(title="invariant-infer", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), code="not_found"
                                       if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    def timed(endpoint: str, handler):
        async def wrapper(request: Request):
            start = time.perf_counter()
            status = 500
            try:
                response = await handler(request)
                status = response.status_code
                return response
            except APIError as exc:
                status = exc.status
                return error_response(exc)
            finally:
                server.metrics.requests.labels(endpoint, str(status)).inc()
                server.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return wrapper

    app.add_api_route("/v1/completions", timed("completions", server.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", timed("chat_completions", server.chat_completions), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            server.check_auth(request)
        except APIError as exc:
            return error_response(exc)
        return JSON({"object": "list", "data": [{"id": options.model_name, "object": "model", "created": 0,
                                                 "owned_by": "invariant-infer",
                                                 "max_model_len": server.engine.max_positions}]})

    @app.get("/health")
    async def health():
        return JSON({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        try:
            server.check_auth(request)
        except APIError as exc:
            return error_response(exc)
        t = tokenizer
        return JSON({"eos_token": t.eos_token, "bos_token": t.bos_token, "pad_token": t.pad_token,
                     "chat_template": getattr(t, "chat_template", None),
                     "model_max_length": server.engine.max_positions, "vocab_size": server.engine.vocab_size})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            server.check_auth(request)
            body = await server.read_json(request)
            add_special = get_bool(body, "add_special_tokens", True)
            if isinstance(body.get("prompt"), str):
                tokens = tokenizer.encode(body["prompt"], add_special_tokens=add_special)
            elif "messages" in body:
                text = tokenizer.apply_chat_template(parse_messages(body["messages"]), tokenize=False,
                                                     add_generation_prompt=get_bool(body, "add_generation_prompt",
                                                                                    True))
                tokens = tokenizer.encode(text, add_special_tokens=add_special)
            else:
                raise bad("'prompt' must be a string", "prompt", "invalid_type")
        except APIError as exc:
            return error_response(exc)
        return JSON({"tokens": tokens, "count": len(tokens), "max_model_len": server.engine.max_positions})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            server.check_auth(request)
            body = await server.read_json(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < len(tokenizer) for t in tokens):
                raise bad("'tokens' must be a list of token ids in the tokenizer's vocabulary", "tokens")
        except APIError as exc:
            return error_response(exc)
        return JSON({"prompt": tokenizer.decode(tokens)})

    return app
