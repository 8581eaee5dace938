"""The request bodies of the pooling routes, in vLLM's shapes (``EmbeddingCompletionRequest``,
``ScoreRequest``, ``RerankRequest``, ``ClassificationRequest``, ``PoolingRequest``), strict as
``protocol``'s: unknown fields and options this server does not implement are refused by name."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .protocol import OpenAIRequest, Text, _unicode, refuse, unsupported


def inputs_of(value, what: str = "input") -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists -> a non-empty
    list of inputs, each a string or a non-empty list of ints; the refusal names the item at fault."""
    if isinstance(value, str):
        return [_unicode(value)]
    if not isinstance(value, list):
        raise refuse(f"'{what}' must be a string, a list of strings, a list of token ids or a list of token-id "
                     "lists", "invalid_type")
    if not value:
        raise refuse(f"'{what}' must not be an empty list")
    if all(type(t) is int for t in value):
        return [value]
    for i, item in enumerate(value):
        if isinstance(item, str):
            _unicode(item)
        elif isinstance(item, list):
            if not item:
                raise refuse(f"'{what}'[{i}] is an empty token-id list")
            if not all(type(t) is int for t in item):
                raise refuse(f"'{what}'[{i}] must be a list of integer token ids", "invalid_type")
        else:
            raise refuse(f"'{what}'[{i}] must be a string or a list of token ids, got {type(item).__name__}",
                         "invalid_type")
    return value


def texts_of(value, what: str) -> list[str]:
    """A string or a non-empty list of strings -> the list."""
    if isinstance(value, str):
        return [_unicode(value)]
    if not isinstance(value, list) or not value:
        raise refuse(f"'{what}' must be a string or a non-empty list of strings", "invalid_type")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise refuse(f"'{what}'[{i}] must be a string, got {type(item).__name__}", "invalid_type")
        _unicode(item)
    return value


class PoolingRouteRequest(OpenAIRequest):
    model: Text | None = None
    user: Any = None  # accepted and ignored, as OpenAI's
    truncate_prompt_tokens: unsupported(lambda v: False) = None  # truncation would change a row's bits silently


class InputRequest(PoolingRouteRequest):
    input: list[str | list[int]]

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value):
        return inputs_of(value)


class EmbeddingRequest(InputRequest):
    """POST /v1/embeddings: OpenAI's (and vLLM's) body."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class PoolingRequest(InputRequest):
    """POST /pooling: the raw pooled output of each input."""
    encoding_format: Literal["float", "base64"] = "float"


class ClassificationRequest(InputRequest):
    """POST /classify."""


class ScoreRequest(PoolingRouteRequest):
    """POST /score, /v1/score: 1-to-1, 1-to-N (``text_1`` one text) or N-to-N (pairwise)."""
    text_1: list[str]
    text_2: list[str]

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _texts(cls, value, info):
        return texts_of(value, info.field_name)


class RerankRequest(PoolingRouteRequest):
    """POST /rerank, /v1/rerank: ``documents`` by relevance to ``query``, the ``top_n`` best (0: all)."""
    query: Text
    documents: list[str]
    top_n: int = Field(0, ge=0)

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, value):
        return texts_of(value, "documents")
