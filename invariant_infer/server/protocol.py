"""The wire format: request validation (every refusal an OpenAI-style 4xx) and response pieces.

Requests are plain JSON objects checked field by field here, so that each bad value gets a 400
naming its ``param`` (FastAPI's own validation would answer 422 in its own shape)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 16
SEED_LIMIT = 2 ** 63


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _is_int(value) -> bool:
    return type(value) is int


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def get_int(body: dict, name: str, default, low: int | None = None, high: int | None = None, nullable=True):
    value = body.get(name, default)
    if value is None and nullable:
        return default
    if not _is_int(value):
        raise bad(f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise bad(f"'{name}' must be in {bounds}, got {value}", name)
    return value


def get_number(body: dict, name: str, default: float, low: float | None = None, high: float | None = None,
               low_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not _is_number(value):
        raise bad(f"'{name}' must be a number, got {value!r}", name, "invalid_type")
    if low is not None and (value < low or (low_open and value == low)):
        raise bad(f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}", name)
    if high is not None and value > high:
        raise bad(f"'{name}' must be <= {high}, got {value}", name)
    return float(value)


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean, got {value!r}", name, "invalid_type")
    return value


def get_stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(value) > 16:
        raise bad("'stop' takes at most 16 strings", "stop")
    return [s for s in value if s]


@dataclass
class Sampling:
    """The sampling fields shared by completions and chat completions."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    n: int
    stream: bool
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict)


# Fields OpenAI defines that this server does not implement: refused, not silently ignored.
UNSUPPORTED = {
    "suffix": lambda v: v is None or v == "",
    "logit_bias": lambda v: v is None or v == {},
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None,
    "function_call": lambda v: v is None,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "parallel_tool_calls": lambda v: v is None,
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
    "min_p": lambda v: v is None or v == 0,
}
# Accepted and ignored: they do not change the tokens.
IGNORED = {"model", "user", "stream_options", "metadata", "store", "service_tier", "reasoning_effort"}


def check_fields(body: dict, known: set[str]) -> None:
    for name, acceptable in UNSUPPORTED.items():
        if name in body and not acceptable(body[name]):
            raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    unknown = sorted(set(body) - known - IGNORED - set(UNSUPPORTED))
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0], "unsupported_parameter")


SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "best_of",
                   "repetition_penalty", "ignore_eos"}


def parse_sampling(body: dict, default_max_tokens: int, max_tokens_name: str = "max_tokens") -> Sampling:
    max_tokens = get_int(body, max_tokens_name, default_max_tokens, low=0)
    n = get_int(body, "n", 1, low=1, high=MAX_N)
    best_of = get_int(body, "best_of", n, low=1)
    if best_of != n:
        raise bad("'best_of' other than n is not supported", "best_of", "unsupported_parameter")
    seed = get_int(body, "seed", None, low=0, high=SEED_LIMIT - 1)
    if seed is not None and seed + n - 1 >= SEED_LIMIT:
        raise bad(f"'seed' + n - 1 must be < 2**63 (choice i uses seed + i)", "seed")
    return Sampling(
        max_tokens=max_tokens,
        temperature=get_number(body, "temperature", 1.0, low=0.0, high=2.0),
        top_p=get_number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_top_k(body),
        seed=seed, stop=get_stop(body), n=n, stream=get_bool(body, "stream", False),
        repetition_penalty=get_number(body, "repetition_penalty", 1.0, low=0.0, low_open=True),
        ignore_eos=get_bool(body, "ignore_eos", False))


def _top_k(body: dict) -> int:
    value = body.get("top_k")
    if value == -1:  # vLLM's "off"
        return 0
    return get_int(body, "top_k", 0, low=0)


def parse_prompts(value) -> list:
    """``prompt`` as a string, a list of strings, a list of token ids or a list of token-id lists ->
    a list of prompts, each a string or a list of ints."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of token-id "
                  "lists (non-empty)", "prompt", "invalid_type")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if all(_is_int(t) for t in value):
        return [list(value)]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
        return [list(p) for p in value]
    raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of non-empty "
              "token-id lists", "prompt", "invalid_type")


def parse_messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages", "invalid_type")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]", "invalid_type")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content",
                          "unsupported_parameter")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", f"messages[{i}].content", "invalid_type")
        messages.append({"role": message["role"], "content": content})
    return messages
