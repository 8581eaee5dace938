"""Prometheus metrics (prometheus-client): the engine's queue, batch and KV pages read at scrape
time, token counters, and each API request's status and latency (an ASGI middleware, so errors
answered by the exception handlers and streams that end early are counted too)."""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import AsyncEngine

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
             "/v1/embeddings": "embeddings", "/score": "score", "/v1/score": "score", "/rerank": "rerank",
             "/v1/rerank": "rerank", "/classify": "classify", "/pooling": "pooling"}
CLIENT_GONE = "499"  # the status label of a request whose client left before any response was sent
RATE_WINDOW_S = 10


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, async_engine: AsyncEngine):
        self.registry = registry = CollectorRegistry()
        self.async_engine = async_engine
        self.queue = Gauge("invariant_infer_queue_length", "Sequences waiting for a slot", registry=registry)
        self.running = Gauge("invariant_infer_running_sequences", "Sequences in the running batch", registry=registry)
        self.pages_used = Gauge("invariant_infer_kv_pages_used", "KV cache pages in use", registry=registry)
        self.pages_total = Gauge("invariant_infer_kv_pages_total", "KV cache pages in all", registry=registry)
        self.in_flight = Gauge("invariant_infer_requests_in_flight", "Engine requests admitted by the server",
                               registry=registry)
        self.tokens_per_s = Gauge("invariant_infer_generation_tokens_per_second",
                                  f"Generated tokens per second over the last {RATE_WINDOW_S} s", registry=registry)
        self.generated = Counter("invariant_infer_generation_tokens", "Generated tokens", registry=registry)
        self.prompt = Counter("invariant_infer_prompt_tokens", "Prompt tokens", registry=registry)
        self.requests = Counter("invariant_infer_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.weight_updates = Counter("invariant_infer_weight_updates", "POST /update_weights_from_disk by result",
                                      ["result"], registry=registry)
        self.weight_update_in_progress = Gauge("invariant_infer_weight_update_in_progress",
                                               "1 while a weight update runs (generation answers 503)",
                                               registry=registry)
        self.latency = Histogram("invariant_infer_request_latency_seconds", "Request latency", ["endpoint"],
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                 registry=registry)
        self._window: deque[tuple[float, int]] = deque()
        # Speculative decoding (vLLM's names): counters brought up to the engine's totals at scrape time.
        self.spec = {name: Counter(f"invariant_infer_{name}", text, registry=registry) for name, text in (
            ("spec_decode_num_drafts", "Verify steps with speculative proposals"),
            ("spec_decode_num_draft_tokens", "Speculative proposals verified"),
            ("spec_decode_num_accepted_tokens", "Speculative proposals accepted"))}
        self._spec_seen = dict.fromkeys(self.spec, 0)
        self.acceptance_length = Gauge("invariant_infer_spec_decode_mean_acceptance_length",
                                       "Tokens per verify step since start: 1 + accepted / drafts", registry=registry)

    def tokens_done(self, count: int) -> None:
        self.generated.inc(count)
        self._window.append((time.monotonic(), count))

    def render(self) -> bytes:
        """The exposition text. It waits for the engine's lock (up to one step): call it off the
        event loop."""
        stats = self.async_engine.stats()
        self.queue.set(stats["waiting"])
        self.running.set(stats["running"])
        self.pages_used.set(stats["kv_pages_used"])
        self.pages_total.set(stats["kv_pages_total"])
        for name, counter in self.spec.items():
            counter.inc(stats.get(name, 0) - self._spec_seen[name])
            self._spec_seen[name] = stats.get(name, 0)
        drafts = stats.get("spec_decode_num_drafts", 0)
        self.acceptance_length.set(1 + stats["spec_decode_num_accepted_tokens"] / drafts if drafts else 0)
        now = time.monotonic()
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()
        self.tokens_per_s.set(sum(c for _, c in self._window) / RATE_WINDOW_S)
        return generate_latest(self.registry)


class RequestMetrics:
    """ASGI middleware: counts each completions request by status and observes its latency, to the
    end of its body (a stream's last event)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        endpoint = ENDPOINTS.get(scope.get("path")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), CLIENT_GONE

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)
        try:
            await self.app(scope, receive, recording_send)
        except Exception:
            if status == CLIENT_GONE:
                status = "500"  # the outer ServerErrorMiddleware answers it
            raise
        finally:
            self.metrics.requests.labels(endpoint, status).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
