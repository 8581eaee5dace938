"""What the routes share: the options, the engine, the tokenizer, the metrics, the choice runner and
the weight updater,
and the checks that need them (the model name, the chat template, the context length)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import AsyncEngine, SamplingParams
from .choices import ChoiceRunner
from .errors import APIError, bad
from .formats import Tokens
from .metrics import Metrics
from .protocol import Message
from .weights import WeightUpdater

DEFAULT_STREAM_WRITE_TIMEOUT_S = 30.0


@dataclass
class ServerOptions:
    """The server's options: what the app serves (read by the routes), and, for ``server.main.serve``,
    the checkpoint, the engine and the socket (``invariant-infer serve`` builds them from its flags)."""
    model_name: str = "model"            # the name clients send
    api_key: str | None = None
    max_waiting: int = 256               # sequences queued beyond max_num_seqs before 429
    max_body_bytes: int = 16 << 20
    stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT_S  # a stream stalled that long is dropped
    # The checkpoint and the engine (read by ``serve``).
    model: str | None = None             # a checkpoint directory or hub id
    task: str | None = None              # "generate" or a pooling task; None: the checkpoint's (``resolve_task``)
    tokenizer: str | None = None         # default: ``model``
    dtype: str | None = None
    device: str | None = None
    tensor_parallel_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False          # no CUDA graphs (``Engine(cuda_graphs=False)``)
    kernels: str = "invariant"
    speculative_config: dict | None = None  # vLLM's speculative_config (``Engine(speculative=...)``)
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT folder, loaded at start
    enable_lora: bool = False            # adapter slots even without lora_modules (for /v1/load_lora_adapter)
    max_loras: int = 1
    max_lora_rank: int = 16
    # The socket and uvicorn.
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "warning"


class ServerState:
    def __init__(self, async_engine: AsyncEngine, tokenizer, options: ServerOptions):
        self.async_engine, self.engine, self.tokenizer, self.options = (async_engine, async_engine.engine,
                                                                        tokenizer, options)
        self.metrics = Metrics(async_engine)
        self.tokens = Tokens(tokenizer)
        self.runner = ChoiceRunner(async_engine, self.metrics, options.model_name,
                                   capacity=self.engine.core.scheduler.max_num_seqs + options.max_waiting,
                                   stream_write_timeout=options.stream_write_timeout)
        self.weights = WeightUpdater(async_engine, self.runner, self.metrics)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter the ``model`` field names (None: the base model's served name, or no name)."""
        if model is None or model == self.options.model_name:
            return None
        if any(a.name == model for a in self.engine.list_loras()):
            return model
        raise APIError(404, f"the model '{model}' does not exist (this server serves "
                       f"'{self.options.model_name}' and its adapters)", param="model", code="model_not_found")

    def adapter_cards(self) -> list[dict]:
        """``/v1/models`` entries of the loaded adapters (vLLM's ``parent``; the sha256 tells what arrived)."""
        return [{"id": a.name, "object": "model", "created": 0, "owned_by": "invariant-infer",
                 "parent": self.options.model_name, "max_model_len": self.engine.max_positions, "rank": a.rank,
                 "sha256": a.sha256} for a in self.engine.list_loras()]

    def encode(self, prompt: str | list[int], add_special_tokens: bool = False, param: str = "prompt") -> list[int]:
        """Token ids as given, or the text's; text the tokenizer refuses gets a 400 naming ``param``."""
        if not isinstance(prompt, str):
            return prompt
        try:
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as exc:  # tokenizers raises TypeError on text it cannot encode
            raise bad(f"the tokenizer cannot encode this text: {type(exc).__name__}: {exc}", param) from None

    def chat_prompt(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad("the tokenizer has no chat template: use /v1/completions", "messages", "no_chat_template")
        try:
            return self.tokenizer.apply_chat_template([m.for_template() for m in messages], tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001  (a template that raises on these messages)
            raise bad(f"the chat template failed on these messages: {exc}", "messages") from None

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """The context length here (OpenAI's code for it), then the engine's own checks: a
        ``RequestError`` names its ``param`` and is answered by its handler."""
        total = len(ids) + params.max_tokens
        if ids and total > self.engine.max_positions:
            raise bad(f"this model's context length is {self.engine.max_positions} tokens; the prompt has "
                      f"{len(ids)} and max_tokens is {params.max_tokens} ({total} in all)", "max_tokens",
                      "context_length_exceeded")
        self.engine.check_request(ids, params)
