"""Scoring a pooled checkpoint's rows (an embedder's embeddings, a head's scores), as ``invariant-infer
score`` writes them for a pooled checkpoint.

A request is one of (besides its ``id``):
  * ``text``: one text, tokenized with the model's special tokens;
  * ``text_1`` + ``text_2``: a pair (a cross-encoder's query and document, as vLLM's score API names
    them), joined as the tokenizer joins two texts;
  * ``input_ids`` (optionally ``token_type_ids``): the row's tokens as they are, special tokens included.
No row is truncated: a row longer than the model takes is an error row. A result is the row's
``embedding`` (embed: pooled, then L2-normalised where the model normalises) or ``scores`` (a head's raw
logits, one per label), float32, and the sha256 ``digest`` of their float32 little-endian bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import InvalidArgumentError, ScoringRequestError, raise_if_device_failure
from ..model.pooled_model import PooledInput, PooledModel
from .core import logprob_digest

POOLED_REQUEST_FIELDS = (("text",), ("text_1", "text_2"), ("input_ids",))
OPTIONAL_FIELDS = {"id", "token_type_ids"}  # token_type_ids: with input_ids only


@dataclass(frozen=True)
class PooledResult:
    """One row's output, float32 on CPU: its embedding, or its head's logits."""
    values: torch.Tensor
    field: str  # "embedding" or "scores": the result row's field that holds them
    num_tokens: int

    @property
    def digest(self) -> str:
        return logprob_digest(self.values)


def _token_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ScoringRequestError(f"{name} must be a list of integers")
    return value


def _text(record: dict, name: str) -> str:
    if not isinstance(record[name], str):
        raise ScoringRequestError(f"{name} must be a string")
    return record[name]


def parse_pooled_request(record: dict, pooled: PooledModel) -> PooledInput:
    """The row of one request (``POOLED_REQUEST_FIELDS``), its length checked; raises ``ScoringRequestError``."""
    fields = set(record) - OPTIONAL_FIELDS
    known = {name for names in POOLED_REQUEST_FIELDS for name in names}
    if fields - known:
        raise ScoringRequestError(f"unknown field(s) {sorted(fields - known)} for a {pooled.task} model")
    if "token_type_ids" in record and fields != {"input_ids"}:
        raise ScoringRequestError("token_type_ids goes with input_ids only")
    try:
        if fields == {"text"}:
            inp = pooled.tokenize(_text(record, "text"))
        elif fields == {"text_1", "text_2"}:
            inp = pooled.tokenize_pair(_text(record, "text_1"), _text(record, "text_2"))
        elif fields == {"input_ids"}:
            types = record.get("token_type_ids")
            inp = PooledInput(list(_token_list(record["input_ids"], "input_ids")),
                              None if types is None else list(_token_list(types, "token_type_ids")))
        else:
            expected = " | ".join("+".join(names) for names in POOLED_REQUEST_FIELDS)
            raise ScoringRequestError(f"need exactly one of {expected}; got {sorted(fields) or 'none'}")
        check_pooled_input(inp, pooled)
    except (InvalidArgumentError, OSError) as exc:
        raise ScoringRequestError(str(exc)) from None
    return inp


def check_pooled_input(inp: PooledInput, pooled: PooledModel) -> None:
    """Its length within the model's limit and its ids in the vocabulary; raises ``InvalidArgumentError``."""
    pooled.check_length(inp)
    vocab = pooled.vocab_size
    bad = [t for t in inp.input_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgumentError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


def pooled_results(pooled: PooledModel, inputs: Sequence[PooledInput]) -> list[PooledResult]:
    """Each row's result, from one padded forward of all of them."""
    rows = pooled.forward_rows(list(inputs))
    if pooled.task == "embed":
        rows, field = pooled.embeddings(rows), "embedding"
    else:
        field = "scores"
    return [PooledResult(row.contiguous(), field, len(inp.input_ids)) for row, inp in zip(rows, inputs)]


def _results_or_error(pooled, inputs) -> list[PooledResult] | str:
    try:
        return pooled_results(pooled, inputs)
    except Exception as exc:  # a device failure is no row's: it raises
        raise_if_device_failure(exc, "scoring a batch")
        return f"scoring failed: {type(exc).__name__}: {exc}"


def score_pooled_group(pooled: PooledModel, inputs: Sequence[PooledInput]) -> list[PooledResult | str]:
    """``pooled_results``, except that a batch that raises is run again row by row (no bit of a row
    changes): a row that raises alone gets its message, a str, in place of its result."""
    scored = _results_or_error(pooled, inputs)
    if not isinstance(scored, str):
        return scored
    if len(inputs) == 1:
        return [scored]
    alone = [_results_or_error(pooled, [inp]) for inp in inputs]
    return [r if isinstance(r, str) else r[0] for r in alone]
