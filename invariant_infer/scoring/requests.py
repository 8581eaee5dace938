"""A scoring request's fields turned into token ids, as the score command and the Ray job read them."""
from __future__ import annotations

from ..checkpoints.loading import LazyTokenizer
from ..errors import ScoringRequestError

# The four shapes of a scoring request, besides its id.
REQUEST_FIELDS = (("input_ids",), ("text",), ("prompt", "completion"), ("prompt_ids", "completion_ids"))
KNOWN_FIELDS = {"id", "lora"} | {name for fields in REQUEST_FIELDS for name in fields}  # lora: an adapter's name


def _token_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ScoringRequestError(f"{name} must be a list of integers")
    return value


def _encode(tokenizer: LazyTokenizer, text, name: str) -> list[int]:
    if not isinstance(text, str):
        raise ScoringRequestError(f"{name} must be a string")
    try:
        loaded = tokenizer.get()
    except OSError as exc:
        raise ScoringRequestError(f"cannot tokenize: {exc}") from None
    return loaded.encode(text, add_special_tokens=False)


def request_lora(record: dict, loras) -> str | None:
    """The request's LoRA adapter (``lora``: a name among ``loras``; absent or null: the base model)."""
    name = record.get("lora")
    if name is not None and (not isinstance(name, str) or name not in loras):
        known = ", ".join(sorted(loras)) or "none (--lora NAME=PATH loads one)"
        raise ScoringRequestError(f"unknown LoRA adapter {name!r} (loaded: {known})")
    return name


def parse_request(record: dict, tokenizer: LazyTokenizer) -> tuple[list[int], int]:
    """(token ids, prompt length) of one scoring request: ``input_ids``, ``text``, ``prompt`` +
    ``completion`` (tokenized separately, no special tokens, ids concatenated) or ``prompt_ids`` +
    ``completion_ids``, besides an optional ``id`` and ``lora`` (``request_lora``). Raises ``ScoringRequestError``."""
    fields = set(record) - {"id", "lora"}
    unknown = sorted(fields - KNOWN_FIELDS)
    if unknown:
        raise ScoringRequestError(f"unknown field(s) {unknown}")
    if fields == {"input_ids"}:
        return _token_list(record["input_ids"], "input_ids"), 1
    if fields == {"text"}:
        return _encode(tokenizer, record["text"], "text"), 1
    if fields == {"prompt", "completion"}:
        prompt = _encode(tokenizer, record["prompt"], "prompt")
        return prompt + _encode(tokenizer, record["completion"], "completion"), len(prompt)
    if fields == {"prompt_ids", "completion_ids"}:
        prompt = _token_list(record["prompt_ids"], "prompt_ids")
        return prompt + _token_list(record["completion_ids"], "completion_ids"), len(prompt)
    for needed in REQUEST_FIELDS:
        if fields and fields <= set(needed):
            raise ScoringRequestError(f"missing field(s) {sorted(set(needed) - fields)}")
    expected = " | ".join("+".join(f) for f in REQUEST_FIELDS)
    raise ScoringRequestError(f"need exactly one of {expected}; got {sorted(fields) or 'none'}")
