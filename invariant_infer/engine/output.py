"""The engine's output path: what each step adds to a request (``SequenceDelta``, from the core),
and ``OutputProcessor``, which turns a request's deltas into the ``RequestOutput``s its caller
asked for: its text, decoded as its tokens come, its stop strings, and the output kind.

Output kinds (``SamplingParams.output_kind``, as vLLM names them): CUMULATIVE, every output holds
everything so far; DELTA, each output holds only what is new since the last (its text too); and
FINAL_ONLY, one output when the request finishes. A step's work is O(new tokens) for DELTA and
FINAL_ONLY, whatever the length.

``Detokenizer`` keeps ``text == tokenizer.decode(ids, skip_special_tokens=...)`` after every token
without decoding the whole output each time. It decodes a window: the tokens of the last committed
piece (context, so that a decoder that treats a first token apart, like SentencePiece's leading
space, sees what the whole decode sees) and the tokens after them; the text is the committed text
plus what the window adds to its context. A piece is committed once it ends on a whole character (a
byte-level BPE splits a character over tokens; an incomplete one decodes to U+FFFD until its last
byte comes), so the window stays a few tokens long and each token costs O(1) amortised. Should a
decoder's window text not begin with its context's text, the step decodes the whole output instead.

Stop strings: the text before the last commit never changes, and held no stop string, so a new one
can only end after it; the search starts a stop string's length before it. A DELTA output's text
holds back the last (longest stop string - 1) characters and a torn character until the request
finishes, since a stop string may be starting there and would cut them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .sampling_params import RequestOutputKind, SamplingParams

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


@dataclass(slots=True)
class SequenceDelta:
    """What one step added to a request: its new tokens and logprobs (copies of those entries only),
    and whether it finished. The engine core's output; ``OutputProcessor`` builds ``RequestOutput``s
    from it."""
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    prompt_logprobs: list[float]
    prompt_top_logprobs: list[dict[int, float]]
    prompt_greedy: list[bool]
    finished: bool
    finish_reason: str | None
    error: str | None = None


def end_delta(request_id: str, reason: str, error: str | None = None) -> SequenceDelta:
    """A delta that adds nothing and finishes the request (an abort, a failed step)."""
    return SequenceDelta(request_id, [], [], [], [], [], [], True, reason, error)


class OutputProcessor:
    """One request's outputs, built from its deltas: text and stop strings (with a tokenizer), and
    the output kind its ``SamplingParams`` ask for (see the module's docstring)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int, tokenizer=None):
        self.request_id, self.prompt_ids, self.params, self.seed = request_id, prompt_ids, params, seed
        self.kind = params.output_kind
        self.detokenizer = Detokenizer(tokenizer, params.stop) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[dict[int, float]] = []
        self.prompt_greedy: list[bool] = []
        self.finished, self.finish_reason, self.error = False, None, None
        # DELTA: what earlier outputs held
        self._sent_tokens = self._sent_prompt = self._sent_text = 0

    @property
    def text(self) -> str | None:
        return self.detokenizer.text if self.detokenizer is not None else None

    def process(self, delta: SequenceDelta) -> tuple[RequestOutput | None, bool]:
        """(the output this delta gives, None when the kind holds it back; whether a stop string
        finished the request here, so that the core must stop it). Tokens after a stop string's are
        dropped, as are deltas after the request finished."""
        if self.finished:
            return None, False
        tokens, stopped = delta.token_ids, False
        finished, reason, error = delta.finished, delta.finish_reason, delta.error
        keep = len(tokens)
        if self.detokenizer is not None:
            for j, token in enumerate(tokens):
                self.detokenizer.add(token)
                # A stop token or EOS finishing the request at this token comes first: no cut.
                if finished and reason == "stop" and j == len(tokens) - 1:
                    break
                if self.detokenizer.cut_at_stop():
                    keep, stopped = j + 1, True
                    finished, reason, error = True, "stop", None
                    break
        self.token_ids += tokens[:keep]
        self.logprobs += delta.logprobs[:keep]
        self.top_logprobs += delta.top_logprobs[:keep]
        self.prompt_logprobs += delta.prompt_logprobs
        self.prompt_top_logprobs += delta.prompt_top_logprobs
        self.prompt_greedy += delta.prompt_greedy
        self.finished, self.finish_reason, self.error = finished, reason, error
        if self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None, stopped
        return self._output(), stopped

    def _output(self) -> RequestOutput:
        params, kind = self.params, self.kind
        wants_prompt = params.prompt_logprobs is not None
        if kind is RequestOutputKind.DELTA:
            t, p = self._sent_tokens, self._sent_prompt
            self._sent_tokens, self._sent_prompt = len(self.token_ids), len(self.prompt_logprobs)
            text = None
            if self.detokenizer is not None:
                whole = self.detokenizer.text
                if not self.finished:  # hold back what a stop string could still cut (module docstring)
                    hold = self.detokenizer.longest_stop - 1
                    whole = whole[:max(0, len(whole) - hold)] if hold > 0 else whole
                    whole = whole.rstrip(INCOMPLETE)
                text = whole[self._sent_text:]
                self._sent_text = max(self._sent_text, len(whole))
            return RequestOutput(
                request_id=self.request_id, prompt_token_ids=self.prompt_ids, token_ids=self.token_ids[t:],
                logprobs=self.logprobs[t:], top_logprobs=self.top_logprobs[t:] if params.logprobs else None,
                prompt_logprobs=self.prompt_logprobs[p:] if wants_prompt else None,
                prompt_top_logprobs=self.prompt_top_logprobs[p:] if params.prompt_logprobs else None,
                prompt_greedy=self.prompt_greedy[p:] if wants_prompt else None, text=text, seed=self.seed,
                finished=self.finished, finish_reason=self.finish_reason, error=self.error)
        # CUMULATIVE copies (later outputs do not change it); FINAL_ONLY is the last output: no copy.
        copy = list if kind is RequestOutputKind.CUMULATIVE else (lambda values: values)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=copy(self.prompt_ids), token_ids=copy(self.token_ids),
            logprobs=copy(self.logprobs), top_logprobs=copy(self.top_logprobs) if params.logprobs else None,
            prompt_logprobs=copy(self.prompt_logprobs) if wants_prompt else None,
            prompt_top_logprobs=copy(self.prompt_top_logprobs) if params.prompt_logprobs else None,
            prompt_greedy=copy(self.prompt_greedy) if wants_prompt else None, text=self.text, seed=self.seed,
            finished=self.finished, finish_reason=self.finish_reason, error=self.error)
