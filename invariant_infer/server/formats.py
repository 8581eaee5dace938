"""Engine outputs in OpenAI's shapes: a completions choice (text, ``echo``, logprobs with
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) and a chat choice (a message,
logprobs as ``content``), whole or as the stream's next piece. A format holds what its stream has
sent of each choice, so each piece carries only what is new."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..engine import RequestOutput, SamplingParams


@dataclass
class Choice:
    """One engine request of a response: choice ``index`` of prompt ``prompt``."""
    index: int
    prompt: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    lora: str | None = None  # the LoRA adapter it runs on (None: the base model)


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


def safe_text(out: RequestOutput, hold: int) -> str:
    """Text that later tokens cannot change: all of it once finished; else less the last
    ``hold - 1`` characters (a stop string may be starting there) and a torn UTF-8 character."""
    text = out.text or ""
    if out.finished:
        return text
    if hold > 1:
        text = text[:max(0, len(text) - (hold - 1))]
    return text.rstrip("\ufffd")


class StreamState:
    """What the stream has sent of each choice: characters of text and generated tokens."""

    def __init__(self, count: int, hold: int):
        self.hold = hold
        self.text, self.tokens, self.started = [0] * count, [0] * count, [False] * count

    def advance(self, k: int, out: RequestOutput) -> tuple[str, int, bool]:
        """(new text, tokens sent before, whether this is the choice's first piece)."""
        text = safe_text(out, self.hold)
        new, sent_tokens, first = text[self.text[k]:], self.tokens[k], not self.started[k]
        self.text[k] = max(self.text[k], len(text))
        self.tokens[k], self.started[k] = len(out.token_ids), True
        return new, sent_tokens, first


class CompletionFormat:
    object = chunk_object = "text_completion"

    def __init__(self, tokens: Tokens, choices: list[Choice], prompt_texts: list[str] | None, echo: bool,
                 logprobs: int | None, hold: int):
        self.tokens, self.choices, self.prompt_texts = tokens, choices, prompt_texts
        self.echo, self.logprobs = echo, logprobs
        self.state = StreamState(len(choices), hold)

    def opening(self) -> list[dict]:
        return []

    def _logprobs(self, out: RequestOutput, with_prompt: bool, generated_from: int, base: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        if with_prompt:
            prompt = out.prompt_token_ids
            tokens += [self.tokens.string(t) for t in prompt]
            values += [None] + list(out.prompt_logprobs)
            prompt_tops = out.prompt_top_logprobs or [None] * len(out.prompt_logprobs)
            tops += [None] + [self.tokens.top(top, prompt[i + 1], value)
                              for i, (top, value) in enumerate(zip(prompt_tops, out.prompt_logprobs))]
            offsets += [min(o, base) for o in self.tokens.offsets(prompt, False)]
        ids = out.token_ids
        gen_tops = out.top_logprobs or [None] * len(ids)
        all_offsets = self.tokens.offsets(ids, True)
        for j in range(generated_from, len(ids)):
            tokens.append(self.tokens.string(ids[j]))
            values.append(out.logprobs[j])
            tops.append(self.tokens.top(gen_tops[j], ids[j], out.logprobs[j]))
            offsets.append(base + min(all_offsets[j], len(out.text or "")))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_text(self, k: int) -> str:
        return self.prompt_texts[self.choices[k].prompt] if self.echo else ""

    def whole(self, k: int, out: RequestOutput) -> dict:
        prefix = self._prompt_text(k)
        return {"index": self.choices[k].index, "text": prefix + (out.text or ""),
                "logprobs": None if self.logprobs is None else self._logprobs(out, self.echo, 0, len(prefix)),
                "finish_reason": out.finish_reason, "seed": out.seed}

    def piece(self, k: int, out: RequestOutput) -> dict:
        new, sent_tokens, first = self.state.advance(k, out)
        prefix = self._prompt_text(k)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self._logprobs(out, self.echo and first, sent_tokens, len(prefix))
        return {"index": self.choices[k].index, "text": (prefix if first else "") + new, "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None, "seed": out.seed}


class ChatFormat:
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, tokens: Tokens, choices: list[Choice], logprobs: bool, hold: int):
        self.tokens, self.choices, self.logprobs = tokens, choices, logprobs
        self.state = StreamState(len(choices), hold)

    def opening(self) -> list[dict]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in self.choices]

    def _logprobs(self, out: RequestOutput, generated_from: int) -> dict | None:
        if not self.logprobs:
            return None
        string = self.tokens.string
        gen_tops = out.top_logprobs or [None] * len(out.token_ids)
        content = []
        for j in range(generated_from, len(out.token_ids)):
            token = string(out.token_ids[j])
            content.append({"token": token, "logprob": out.logprobs[j], "bytes": list(token.encode()),
                            "top_logprobs": [{"token": string(t), "logprob": v, "bytes": list(string(t).encode())}
                                             for t, v in (gen_tops[j] or {}).items()]})
        return {"content": content}

    def whole(self, k: int, out: RequestOutput) -> dict:
        return {"index": self.choices[k].index, "message": {"role": "assistant", "content": out.text or ""},
                "logprobs": self._logprobs(out, 0), "finish_reason": out.finish_reason, "seed": out.seed}

    def piece(self, k: int, out: RequestOutput) -> dict:
        new, sent_tokens, _ = self.state.advance(k, out)
        return {"index": self.choices[k].index, "delta": {"content": new},
                "logprobs": self._logprobs(out, sent_tokens),
                "finish_reason": out.finish_reason if out.finished else None, "seed": out.seed}
