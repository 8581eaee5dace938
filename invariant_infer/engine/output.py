"""The engine's output path: each request's text, decoded as its tokens come, its stop strings, and
the ``RequestOutput`` a step returns.

``Detokenizer`` keeps ``text == tokenizer.decode(ids, skip_special_tokens=...)`` after every token
without decoding the whole output each time. It decodes a window: the tokens of the last committed
piece (context, so that a decoder that treats a first token apart, like SentencePiece's leading
space, sees what the whole decode sees) and the tokens after them; the text is the committed text
plus what the window adds to its context. A piece is committed once it ends on a whole character (a
byte-level BPE splits a character over tokens; an incomplete one decodes to U+FFFD until its last
byte comes), so the window stays a few tokens long and each token costs O(1) amortised. Should a
decoder's window text not begin with its context's text, the step decodes the whole output instead.

Stop strings: the text before the last commit never changes, and held no stop string, so a new one
can only end after it; the search starts a stop string's length before it.
"""
from __future__ import annotations

from dataclasses import dataclass

INCOMPLETE = "\ufffd"  # what a character cut by the window's end decodes to


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]                      # of each generated token, of logprobs_mode's distribution
    top_logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[float] | None        # of prompt tokens 1 .. len - 1
    prompt_top_logprobs: list[dict[int, float]] | None
    prompt_greedy: list[bool] | None           # whether each of those prompt tokens was the argmax
    text: str | None
    seed: int                                  # replays the sample: pass it back as SamplingParams.seed
    finished: bool
    finish_reason: str | None                  # "stop", "length", "abort" or "error"
    error: str | None = None


class Detokenizer:
    """The text of one request's output tokens, kept as they are appended (see the module's docstring)."""

    def __init__(self, tokenizer, stop=(), skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.stop = tuple(stop)
        self.longest_stop = max(map(len, self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        self._committed = ""      # decode(ids[:read]): a prefix of every later text
        self._prefix = 0          # ids[prefix:read]: the window's context
        self._read = 0
        self._prefix_text = ""    # decode(ids[prefix:read])
        self._search_from = 0     # where a stop string first appearing in this token's text can begin

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Append a token; returns the whole text, equal to decoding every token so far."""
        self._search_from = max(0, len(self._committed) - self.longest_stop + 1)
        self.ids.append(token)
        window = self._decode(self.ids[self._prefix:])
        if window.startswith(self._prefix_text):
            self.text = self._committed + window[len(self._prefix_text):]
        else:  # this decoder's text is not additive here: decode it all, and search it all
            self.text, self._search_from = self._decode(self.ids), 0
        # Commit only new text ending on a whole character: an empty step (a skipped special token)
        # keeps its context, which a following token's decode may need.
        if len(self.text) > len(self._committed) and not self.text.endswith(INCOMPLETE):
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix:])
            self._committed = self.text
        return self.text

    def cut_at_stop(self) -> bool:
        """If a stop string appears in the text, cut the text before the first one and return True.
        The same cut as searching the whole text: only this token's text can hold a new one."""
        cuts = [i for i in (self.text.find(stop, self._search_from) for stop in self.stop) if i >= 0]
        if not cuts:
            return False
        self.text = self.text[:min(cuts)]
        return True


def finish_reason(seq, token: int, eos_token_ids: set[int], max_positions: int) -> str | None:
    """Bring ``seq.text`` up to its new last token ``token`` (``seq``: the engine's ``Sequence``, not
    imported: it imports this module); "stop" or "length" if the sequence finishes here (a stop
    string cuts the text before it), else None."""
    params, detokenizer = seq.params, seq.detokenizer
    if detokenizer is not None:
        seq.text = detokenizer.add(token)
    if token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
        return "stop"
    if detokenizer is not None and detokenizer.cut_at_stop():
        seq.text = detokenizer.text
        return "stop"
    if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= max_positions:
        return "length"
    return None


def request_output(seq, with_text: bool) -> RequestOutput:
    """The output of ``seq`` so far (copies: later steps do not change it)."""
    params = seq.params
    return RequestOutput(
        request_id=seq.request_id, prompt_token_ids=list(seq.prompt_ids), token_ids=list(seq.output_ids),
        logprobs=list(seq.logprobs), top_logprobs=list(seq.top_logprobs) if params.logprobs else None,
        prompt_logprobs=list(seq.prompt_logprobs) if seq.wants_prompt_logprobs else None,
        prompt_top_logprobs=list(seq.prompt_top_logprobs) if params.prompt_logprobs else None,
        prompt_greedy=list(seq.prompt_greedy) if seq.wants_prompt_logprobs else None,
        text=seq.text if with_text else None, seed=seq.seed, finished=seq.finished,
        finish_reason=seq.finish_reason, error=seq.error)
