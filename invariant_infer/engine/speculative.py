"""Speculative decoding that changes no bit: proposals are verified in one chunk, and each verified
position's token is the one plain decoding would pick there.

A speculating sequence's step is one chunk of 1 + d positions: its last token and d proposed ones
(``proposers``: prompt lookup, or a draft model). The engine's chunks give each row bitwise the
logits a one-token decode step gives at that position (every kernel computes a row alone, with a
fixed configuration whatever the row count), so row i's token, from the target's own sampler (the
argmax, or the seeded draw keyed by the request and its position), is plain decoding's token there
once proposals 0 .. i-1 are accepted. A proposal is accepted while it equals that token; the first
mismatch takes the target's token and ends the step. Logprobs, top logprobs and stop checks then run
on those tokens exactly as on decoded ones.

KV of rejected positions is rolled back: the sequence counts as computed only up to its accepted
tokens, its pages past them are freed (they hold no registered prefix: a page is registered only
once its computed, accepted positions fill it), and the next step overwrites the stale slots.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .sequence import Sequence
from ..errors import SpeculativeConfigError
from ..model.support import require

METHODS = ("ngram", "draft_model")
ACCEPTANCES = ("exact", "rejection")
DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX = 1, 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` shape: ``method`` "ngram" (prompt lookup: the tokens that followed
    the latest earlier occurrence of the sequence's last n tokens, n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``; default 1 and 5, one given sets both) or "draft_model" (``model``: a smaller
    causal LM, or its checkpoint path, with the target's tokenizer; its own KV pages). ``acceptance``:
    "exact" only (rejection sampling keeps the distribution but not the bits)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: Any = None
    acceptance: str = "exact"
    draft_kv_cache_memory: int | None = None  # draft_model: bytes of its KV pages (default: as many positions)

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """A config from a dict (vLLM's keys), a config, or None (off); unknown keys are refused."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise SpeculativeConfigError("speculative must be a dict or a SpeculativeConfig, got "
                                         f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative: unknown keys {unknown} (known: {sorted(known)})")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise SpeculativeConfigError("speculative needs 'method' and 'num_speculative_tokens'")
        return cls(**value)

    def check(self, max_positions: int, max_num_batched_tokens: int) -> None:
        """Raise ``ValueError`` with the reason for values that cannot run, or would break exactness."""
        k = self.num_speculative_tokens
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if type(k) is not int or k < 1:
            raise SpeculativeConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if k + 1 > max_num_batched_tokens or k + 1 >= max_positions:
            raise SpeculativeConfigError(f"num_speculative_tokens={k}: a verify step of {k + 1} positions must fit in "
                                         f"max_num_batched_tokens ({max_num_batched_tokens}) and the model's "
                                         f"{max_positions} positions")
        if self.acceptance not in ACCEPTANCES:
            raise SpeculativeConfigError(f"acceptance must be one of {', '.join(ACCEPTANCES)}, got {self.acceptance!r}")
        if self.acceptance == "rejection":
            raise SpeculativeConfigError("acceptance='rejection' is not implemented: rejection sampling keeps the "
                                         "distribution but changes the tokens and logprobs; 'exact' keeps every bit")
        if self.method == "ngram":
            low, high = self.lookup_range
            if self.model is not None:
                raise SpeculativeConfigError("method 'ngram' takes no draft model (use method 'draft_model')")
            if not (type(low) is int and type(high) is int and 1 <= low <= high):
                raise SpeculativeConfigError(f"prompt_lookup_min ({low!r}) and prompt_lookup_max ({high!r}) must be "
                                             "integers with 1 <= min <= max")
        else:
            if self.model is None:
                raise SpeculativeConfigError("method 'draft_model' needs 'model': a causal LM or its checkpoint path")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise SpeculativeConfigError("prompt_lookup_min / prompt_lookup_max are for method 'ngram'")

    @property
    def lookup_range(self) -> tuple[int, int]:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        return (high if low is None else low), (low if high is None else high)  # one given: both (vLLM's)


@dataclass
class SpeculativeStats:
    num_drafts: int = 0             # verify steps with at least one proposal
    num_draft_tokens: int = 0       # proposals verified
    num_accepted_tokens: int = 0    # proposals accepted (and kept: none after a stop)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 (the target's own) + accepted proposals (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def verify(draft: list[int], pick: Callable[[int, list[int]], int | None]) -> list[int]:
    """The tokens plain decoding picks at a verify step's rows 0 .. len(draft): ``pick(i, before)``
    is row i's token with proposals 0 .. i-1 in place (``before``: the tokens picked ahead of it,
    which a repetition penalty sees; None: the sequence has no room for it). Up to and including
    the first that differs from its proposal."""
    picked: list[int] = []
    for i in range(len(draft) + 1):
        token = pick(i, picked)
        if token is None:
            break
        picked.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return picked


class SpeculativeDecoder:
    """One engine's speculation: proposes before each step, verifies after its forward."""

    def __init__(self, config: SpeculativeConfig, proposer, max_positions: int):
        self.config, self.proposer, self.max_positions = config, proposer, max_positions
        self.stats = SpeculativeStats()

    def wants(self, seq: Sequence) -> bool:
        """The sequence decodes (its one uncomputed token is a generated one) and speculates."""
        return seq.params.speculative and seq.num_output_tokens > 0 and seq.num_computed == seq.num_tokens - 1

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's ``draft_ids``: at most k proposals, none past its max_tokens
        (no verified position is wasted) or the model's positions."""
        wanted = []
        for seq in running:
            seq.draft_ids = []
            room = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_positions - seq.num_tokens)
            if room > 0 and self.wants(seq):
                wanted.append((seq, room))
        for seq, draft in self.proposer.propose(wanted, running):
            seq.draft_ids = draft

    def settle(self, blocks, chunks) -> None:
        """After the step's tokens are appended: count the accepted positions' KV as computed, register
        the pages they fill and free the pages past them."""
        for chunk in chunks:
            seq = chunk.seq
            if seq.finished:
                self.proposer.release(seq.request_id)
            if not chunk.draft:
                continue
            appended = seq.num_tokens - chunk.start - 1
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(chunk.draft)
            self.stats.num_accepted_tokens += max(0, appended - 1)
            if seq.finished or not seq.pages:
                continue  # its pages are already released
            seq.num_computed = seq.num_tokens - 1
            blocks.register_full_pages(seq)
            blocks.trim(seq)


def speculative_decoder(engine, value, kernels: str) -> SpeculativeDecoder | None:
    """The engine's speculation for ``Engine(..., speculative=value)`` (None: off); refuses, with the
    reason, what cannot run or would not be exact."""
    config = SpeculativeConfig.from_value(value)
    if config is None:
        return None
    config.check(engine.max_positions, engine.scheduler.max_num_batched_tokens)
    if kernels != "invariant":
        require("stock_kernels", "speculative")
    from .proposers import DraftModelProposer, NgramProposer  # noqa: PLC0415  (it imports the runner)
    if config.method == "ngram":
        return SpeculativeDecoder(config, NgramProposer(*config.lookup_range), engine.max_positions)
    # Under tensor parallelism the draft runs unsharded in the lead rank's process (vLLM's
    # draft_tensor_parallel_size=1): a small model, whose numerics only decide acceptance.
    draft = load_draft(config.model, engine)
    blocks = engine.blocks
    proposer = DraftModelProposer(draft, invariant=True, num_positions=blocks.num_pages * blocks.page_size,
                                  kv_cache_memory=config.draft_kv_cache_memory,
                                  max_num_seqs=engine.scheduler.max_num_seqs,
                                  max_num_batched_tokens=engine.scheduler.max_num_batched_tokens)
    return SpeculativeDecoder(config, proposer, engine.max_positions)


def load_draft(model, engine):
    """The draft model (loaded in the target's dtype, on its device, from a path), refused if its
    vocabulary or tokenizer differs from the target's."""
    head = engine.model.get_output_embeddings().weight
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        from transformers import AutoModelForCausalLM  # noqa: PLC0415
        path = str(model)
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=head.dtype).to(head.device).eval()
        if engine.tokenizer is not None:
            check_same_tokenizer(path, engine.tokenizer)
    else:
        draft = model
    if not hasattr(draft, "get_output_embeddings") or draft.get_output_embeddings() is None:
        raise SpeculativeConfigError("the draft model must be a causal LM (AutoModelForCausalLM)")
    if draft.config.vocab_size != engine.vocab_size:
        raise SpeculativeConfigError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from "
                                     f"the target's ({engine.vocab_size}): its proposals would be other tokens")
    if draft.get_output_embeddings().weight.device != head.device:
        raise SpeculativeConfigError(f"the draft model is on {draft.get_output_embeddings().weight.device}, the "
                                     f"target on {head.device}: put them on one device")
    return draft


def check_same_tokenizer(path: str, tokenizer) -> None:
    from ..checkpoints.loading import load_tokenizer  # noqa: PLC0415
    try:
        draft_tokenizer = load_tokenizer(path)
    except OSError:
        return  # a checkpoint without tokenizer files: its vocabulary size was checked
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SpeculativeConfigError(f"the draft model's tokenizer ({path}) differs from the target's: the same ids "
                                     "would be other tokens")
