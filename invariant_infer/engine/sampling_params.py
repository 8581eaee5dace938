"""Per-request sampling parameters, checked at admission."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..errors import RequestError


MAX_LOGPROBS = 20
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


class RequestOutputKind(enum.Enum):
    """What each output of a request holds (vLLM's names and values)."""
    CUMULATIVE = 0   # everything so far, in every output
    DELTA = 1        # only what is new since the last output
    FINAL_ONLY = 2   # one output, when the request finishes


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0         # 0: greedy
    top_k: int = 0                   # 0: off
    top_p: float = 1.0
    seed: int | None = None          # None: drawn at admission and returned with the result
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (need a tokenizer)
    ignore_eos: bool = False
    logprobs: int | None = None      # top alternatives per generated token (0: the sampled token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Which distribution every reported logprob (sampled tokens, top alternatives, prompt tokens) is of:
    # "raw_logprobs", the model's own, log_softmax(logits); "processed_logprobs", the temperature-scaled
    # one the sampler draws from, log_softmax(logits.float() / temperature) (temperature 0, greedy: T = 1).
    # Only the temperature is applied to them, so processed_logprobs with top_k, top_p < 1 or
    # repetition_penalty != 1 is refused rather than reported for a distribution it was not sampled from.
    logprobs_mode: str = "raw_logprobs"
    speculative: bool = True         # False: this request never speculates (in an engine that does)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    @property
    def logprob_temperature(self) -> float:
        """The temperature the reported logprobs are taken at."""
        return self.temperature if self.logprobs_mode == "processed_logprobs" and self.temperature > 0 else 1.0

    def check(self) -> None:
        """Raise ``RequestError`` for values out of range or of the wrong type."""
        def need(ok: bool, param: str, message: str):
            if not ok:
                raise RequestError(message, param=param)

        need(type(self.max_tokens) is int and self.max_tokens >= 0, "max_tokens",
             f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and value == value, name,
                 f"{name} must be a number, got {value!r}")
        need(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        need(type(self.top_k) is int and self.top_k >= 0, "top_k",
             f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        need(self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(self.seed is None or (type(self.seed) is int and 0 <= self.seed < 2 ** 63), "seed",
             f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        need(all(type(t) is int for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be integers")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or (type(value) is int and 0 <= value <= MAX_LOGPROBS), name,
                 f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        need(type(self.speculative) is bool, "speculative", f"speculative must be a bool, got {self.speculative!r}")
        need(isinstance(self.output_kind, RequestOutputKind), "output_kind",
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        need(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode",
             f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.logprobs_mode == "processed_logprobs":
            for name, off in (("top_k", 0), ("top_p", 1.0), ("repetition_penalty", 1.0)):
                need(getattr(self, name) == off, name,
                     f"logprobs_mode='processed_logprobs' reports logprobs at the temperature only, without "
                     f"{name}: {name} must be {off} with it, got {getattr(self, name)!r}")
