"""Engine outputs in OpenAI's shapes: a completions choice (text, ``echo``, logprobs with
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) and a chat choice (a message,
logprobs as ``content``), whole (from a request's final output) or as the stream's next piece
(from its DELTA outputs: the new tokens and the new text, which the engine holds back while a stop
string may be starting)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..engine import RequestOutput, SamplingParams
from ..engine.output import Detokenizer


@dataclass
class Choice:
    """One engine request of a response: choice ``index`` of prompt ``prompt``."""
    index: int
    prompt: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    lora: str | None = None  # the LoRA adapter it runs on (None: the base model)
    prompt_inputs: object = None  # its images, as the engine prepared them (prompt_ids then holds their tokens)


class Tokens:
    """Token strings (each id decoded alone, cached) and character offsets."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.string = lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))

    def top(self, top: dict[int, float] | None, own_id: int, own: float) -> dict[str, float]:
        """Alternatives keyed by token string, always with the chosen token; where two ids read the
        same, the higher logprob is kept."""
        merged: dict[str, float] = {}
        for token_id, value in list((top or {}).items()) + [(own_id, own)]:
            key = self.string(token_id)
            if key not in merged or value > merged[key]:
                merged[key] = value
        return merged

    def offsets(self, ids: list[int], skip_special: bool) -> list[int]:
        decode = self.tokenizer.decode
        return [len(decode(ids[:i], skip_special_tokens=skip_special)) for i in range(len(ids))]


class StreamState:
    """What the stream has sent of each choice: whether its first piece went, its text's length,
    and its tokens' text (each token's character offset, without decoding the whole output again)."""

    def __init__(self, tokenizer, count: int):
        self.started, self.sent_text = [False] * count, [0] * count
        self.decoded = [Detokenizer(tokenizer) for _ in range(count)]

    def advance(self, k: int, out: RequestOutput) -> bool:
        """Count a piece as sent; whether it is the choice's first."""
        first = not self.started[k]
        self.started[k] = True
        self.sent_text[k] += len(out.text or "")
        return first

    def offsets(self, k: int, out: RequestOutput) -> list[int]:
        """Each new token's offset in the choice's text (that of decoding the tokens before it),
        at most the text's length: once a stop string cut the text, the text sent."""
        decoded, offsets = self.decoded[k], []
        for token in out.token_ids:
            offsets.append(len(decoded.text))
            decoded.add(token)
        end = self.sent_text[k] if out.finished else len(decoded.text)
        return [min(o, end) for o in offsets]


class CompletionFormat:
    object = chunk_object = "text_completion"

    def __init__(self, tokens: Tokens, choices: list[Choice], prompt_texts: list[str] | None, echo: bool,
                 logprobs: int | None):
        self.tokens, self.choices, self.prompt_texts = tokens, choices, prompt_texts
        self.echo, self.logprobs = echo, logprobs
        self.state = StreamState(tokens.tokenizer, len(choices))

    def opening(self) -> list[dict]:
        return []

    def _logprobs(self, out: RequestOutput, with_prompt: bool, base: int, offsets: list[int]) -> dict:
        """``out``'s tokens, from character ``base`` at their ``offsets`` (with the prompt's first)."""
        tokens, values, tops, all_offsets = [], [], [], []
        if with_prompt:
            prompt = out.prompt_token_ids
            tokens += [self.tokens.string(t) for t in prompt]
            values += [None] + list(out.prompt_logprobs)
            prompt_tops = out.prompt_top_logprobs or [None] * len(out.prompt_logprobs)
            tops += [None] + [self.tokens.top(top, prompt[i + 1], value)
                              for i, (top, value) in enumerate(zip(prompt_tops, out.prompt_logprobs))]
            all_offsets += [min(o, base) for o in self.tokens.offsets(prompt, False)]
        ids = out.token_ids
        gen_tops = out.top_logprobs or [None] * len(ids)
        for j in range(len(ids)):
            tokens.append(self.tokens.string(ids[j]))
            values.append(out.logprobs[j])
            tops.append(self.tokens.top(gen_tops[j], ids[j], out.logprobs[j]))
            all_offsets.append(base + offsets[j])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": all_offsets}

    def _prompt_text(self, k: int) -> str:
        return self.prompt_texts[self.choices[k].prompt] if self.echo else ""

    def whole(self, k: int, out: RequestOutput) -> dict:
        prefix = self._prompt_text(k)
        logprobs = None
        if self.logprobs is not None:
            text = out.text or ""
            offsets = [min(o, len(text)) for o in self.tokens.offsets(out.token_ids, True)]
            logprobs = self._logprobs(out, self.echo, len(prefix), offsets)
        return {"index": self.choices[k].index, "text": prefix + (out.text or ""), "logprobs": logprobs,
                "finish_reason": out.finish_reason, "seed": out.seed}

    def piece(self, k: int, out: RequestOutput) -> dict:
        first = self.state.advance(k, out)
        prefix = self._prompt_text(k)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self._logprobs(out, self.echo and first, len(prefix), self.state.offsets(k, out))
        return {"index": self.choices[k].index, "text": (prefix if first else "") + (out.text or ""),
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None, "seed": out.seed}


class ChatFormat:
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, tokens: Tokens, choices: list[Choice], logprobs: bool):
        self.tokens, self.choices, self.logprobs = tokens, choices, logprobs
        self.state = StreamState(tokens.tokenizer, len(choices))

    def opening(self) -> list[dict]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in self.choices]

    def _logprobs(self, out: RequestOutput) -> dict | None:
        if not self.logprobs:
            return None
        string = self.tokens.string
        gen_tops = out.top_logprobs or [None] * len(out.token_ids)
        content = []
        for j in range(len(out.token_ids)):
            token = string(out.token_ids[j])
            content.append({"token": token, "logprob": out.logprobs[j], "bytes": list(token.encode()),
                            "top_logprobs": [{"token": string(t), "logprob": v, "bytes": list(string(t).encode())}
                                             for t, v in (gen_tops[j] or {}).items()]})
        return {"content": content}

    def whole(self, k: int, out: RequestOutput) -> dict:
        return {"index": self.choices[k].index, "message": {"role": "assistant", "content": out.text or ""},
                "logprobs": self._logprobs(out), "finish_reason": out.finish_reason, "seed": out.seed}

    def piece(self, k: int, out: RequestOutput) -> dict:
        self.state.advance(k, out)
        return {"index": self.choices[k].index, "delta": {"content": out.text or ""},
                "logprobs": self._logprobs(out),
                "finish_reason": out.finish_reason if out.finished else None, "seed": out.seed}
