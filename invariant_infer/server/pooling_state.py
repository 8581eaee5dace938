"""What the pooling routes share: the pooled model, its batching engine, the options and the metrics,
and the checks that need them (the model name, the task, each input's tokens and length)."""
from __future__ import annotations

import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..errors import InvalidArgumentError
from .errors import APIError, bad

# The routes each task serves (vLLM's: an embedder scores pairs by the cosine of their embeddings, a
# cross-encoder runs the pair through its head; a reward model has the raw /pooling route only).
TASK_ROUTES = {
    "embed": ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/pooling"),
    "score": ("/score", "/v1/score", "/rerank", "/v1/rerank", "/classify", "/pooling"),
    "classify": ("/classify", "/pooling"),
    "reward": ("/pooling",),
}
POOLING_ROUTES = ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/classify", "/pooling")


class PoolingMetrics:
    """Prometheus metrics of a pooled server: requests by endpoint and status, latency (the same
    names as the generation server's), prompt tokens, rows waiting and forward batches run."""
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("invariant_infer_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.latency = Histogram("invariant_infer_request_latency_seconds", "Request latency", ["endpoint"],
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                 registry=registry)
        self.prompt = Counter("invariant_infer_prompt_tokens", "Prompt tokens", registry=registry)
        self.queue = Gauge("invariant_infer_queue_length", "Rows waiting for a batch", registry=registry)
        self.batches = Gauge("invariant_infer_pooling_batches", "Forward batches run", registry=registry)

    def render(self) -> bytes:
        self.queue.set(self.engine.waiting())
        self.batches.set(self.engine.batches)
        return generate_latest(self.registry)


class PoolingServerState:
    def __init__(self, engine, options):
        self.engine, self.model, self.options = engine, engine.model, options
        self.task, self.tokenizer = self.model.task, self.model.tokenizer
        self.metrics = PoolingMetrics(engine)
        config = getattr(self.model.model, "config", None)
        self.vocab_size = getattr(config, "vocab_size", None) or len(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.model_name:
            raise APIError(404, f"the model '{model}' does not exist (this server serves '{self.options.model_name}')",
                           param="model", code="model_not_found")

    def require(self, route: str) -> None:
        """A 400 naming the task when ``route`` is not one it serves."""
        served = TASK_ROUTES[self.task]
        if route not in served:
            raise bad(f"{route} is not served for task '{self.task}' ('{self.options.model_name}'); this server "
                      f"serves {', '.join(served)}", code="unsupported_task")

    def card(self) -> dict:
        return {"id": self.options.model_name, "object": "model", "created": 0, "owned_by": "invariant-infer",
                "max_model_len": self.model.max_length, "task": self.task}

    def encode(self, item: str | list[int], param: str):
        """A text (tokenized as the checkpoint does, special tokens included) or token ids as given -> a
        ``PooledInput`` the model takes; a 400 naming ``param`` otherwise."""
        from ..model.pooled_model import PooledInput

        if isinstance(item, str):
            try:
                inp = self.model.tokenize(item)
            except (TypeError, ValueError) as exc:  # tokenizers raises TypeError on text it cannot encode
                raise bad(f"'{param}': the tokenizer cannot encode this text: {type(exc).__name__}: {exc}",
                          param) from None
        else:
            wrong = [t for t in item if not 0 <= t < self.vocab_size]
            if wrong:
                raise bad(f"'{param}': token id {wrong[0]} is outside the vocabulary (0 .. {self.vocab_size - 1})",
                          param)
            inp = PooledInput(list(item))
        return self._checked(inp, param)

    def encode_pair(self, text_1: str, text_2: str, param: str):
        try:
            inp = self.model.tokenize_pair(text_1, text_2)
        except (TypeError, ValueError) as exc:
            raise bad(f"'{param}': the tokenizer cannot encode this pair: {type(exc).__name__}: {exc}",
                      param) from None
        return self._checked(inp, param)

    def _checked(self, inp, param: str):
        if not inp.input_ids:
            raise bad(f"'{param}': the text tokenizes to no tokens", param)
        try:
            self.model.check_length(inp)
        except InvalidArgumentError as exc:
            raise bad(f"'{param}': {exc}", param, "context_length_exceeded") from None
        return inp

    async def run(self, inputs: list, finish=None) -> torch.Tensor:
        """The model's rows for ``inputs`` [N, D] through the batching engine (``finish`` applied to each
        row on its worker); a refusal of the model (a bad input it names) is a 400."""
        self.metrics.prompt.inc(sum(len(i.input_ids) for i in inputs))
        try:
            return await self.engine.run(inputs, finish)
        except InvalidArgumentError as exc:
            raise bad(str(exc)) from None

    async def embeddings(self, inputs: list, dimensions: int | None = None) -> torch.Tensor:
        """The embeddings of ``inputs`` [N, D'] (``PooledModel.embeddings``: truncated, normalised)."""
        if dimensions is not None:
            try:
                self.model.check_dimensions(dimensions)
            except InvalidArgumentError as exc:
                raise bad(f"'dimensions': {exc}", "dimensions") from None
        return await self.run(inputs, lambda rows: self.model.embeddings(rows, dimensions))
