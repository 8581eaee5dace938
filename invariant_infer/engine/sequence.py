"""One request's state inside the engine.

A sequence's tokens are one list, the prompt then the generated tokens, appended in place: nothing
in a step rebuilds it, so a step's work for a sequence does not grow with its length."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]              # the request's prompt (never changed)
    params: SamplingParams
    seed: int
    arrival: int                       # admission order (FCFS)
    status: Status = Status.WAITING
    pages: list[list[int]] = field(default_factory=list)  # per KV cache group: page j, positions [j*P, (j+1)*P)
    block_row: int | None = None       # its row of the block tables while it holds pages (kv_cache_manager.py)
    num_computed: int = 0              # tokens whose KV is in the cache
    num_hashed_pages: int = 0          # leading full pages registered for prefix caching
    page_hashes: list[bytes] = field(default_factory=list)  # prefix hash of each full page, computed lazily
    draft_ids: list[int] = field(default_factory=list)  # this step's speculative proposals (verified, not kept)
    lora: str | None = None            # the LoRA adapter it runs (None: the base model)
    hash_seed: bytes = b""             # starts its page hash chain: the adapter's digest, so hits never cross adapters
    prompt_inputs: object = None       # what its prompt brings besides its ids (model.prompt_inputs.PromptInputs)
    # Results. Logprobs are of the model's own distribution (before penalty, temperature, top-k/p), or
    # at the temperature with logprobs_mode="processed_logprobs".
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)       # prompt tokens 1.. len-1
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_greedy: list[bool] = field(default_factory=list)
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    error: str | None = None
    # What the step outputs have reported so far (each output carries what came after).
    num_reported_tokens: int = 0
    num_reported_prompt_logprobs: int = 0
    # The prompt, then the generated tokens (see the module's docstring).
    token_ids: list[int] = field(init=False, repr=False)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.num_prompt_tokens = len(self.prompt_ids)

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens from position ``num_tokens`` on (a draft model's rejected proposals)."""
        del self.token_ids[num_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def output_ids(self) -> tuple[int, ...]:
        """The generated tokens (a copy: not for the per-step path; ``append_token`` adds one)."""
        return tuple(self.token_ids[self.num_prompt_tokens:])

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
