"""One request's state inside the engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .output import Detokenizer
from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int                       # admission order (FCFS)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)  # block table: page j holds positions [j*P, (j+1)*P)
    num_computed: int = 0              # tokens whose KV is in the cache
    num_hashed_pages: int = 0          # leading full pages registered for prefix caching
    page_hashes: list[bytes] = field(default_factory=list)  # prefix hash of each full page, computed lazily
    draft_ids: list[int] = field(default_factory=list)  # this step's speculative proposals (verified, not kept)
    lora: str | None = None            # the LoRA adapter it runs (None: the base model)
    hash_seed: bytes = b""             # starts its page hash chain: the adapter's digest, so hits never cross adapters
    # Results. Logprobs are of the model's own distribution (before penalty, temperature, top-k/p), or
    # at the temperature with logprobs_mode="processed_logprobs".
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)       # prompt tokens 1.. len-1
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_greedy: list[bool] = field(default_factory=list)
    text: str = ""
    detokenizer: Detokenizer | None = field(default=None, repr=False)  # set when the engine has a tokenizer
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
