"""Loading checkpoints and scoring requests as every CLI and job does: the dtype and device
choice, the model and its tokenizer, and a scoring request's fields turned into token ids. One
place, so the CLIs, the server and the Ray workers load a checkpoint and read a request alike."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from .errors import InvariantInferError
from .patch import make_invariant

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEVICES = ("cpu", "cuda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# The four shapes of a scoring request, besides its id.
REQUEST_FIELDS = (("input_ids",), ("text",), ("prompt", "completion"), ("prompt_ids", "completion_ids"))
KNOWN_FIELDS = {"id"} | {name for fields in REQUEST_FIELDS for name in fields}


def resolve_device(device: str | None = None) -> torch.device:
    """``device`` as given, else CUDA when present, else CPU."""
    if device is not None and device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """``dtype`` by name ("bf16", "fp16", "fp32"); default bf16 on CUDA and fp32 on CPU (CPU bf16
    matmuls are slow and the interpreter gains nothing from them)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]


def load_model(path: str, *, dtype: str | None = None, device: str | None = None, invariant: bool = True):
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype`` on ``device``, in eval mode, and
    wrapped by ``make_invariant`` unless ``invariant`` is False (the stock baselines)."""
    where = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, where)).to(where).eval()
    return make_invariant(model) if invariant else model


def load_tokenizer(path: str):
    """The tokenizer saved at ``path`` (a directory or a hub id).

    Refuses a directory without tokenizer files (transformers 5 would build an empty tokenizer
    from ``config.json`` alone). A ``PreTrainedTokenizerFast`` config is loaded as that class:
    ``AutoTokenizer`` would build the model type's own tokenizer class around its files."""
    folder = Path(path)
    if folder.is_dir():
        if not any((folder / name).exists() for name in TOKENIZER_FILES):
            raise OSError(f"no tokenizer in {path}: none of {', '.join(TOKENIZER_FILES)} found")
        config = folder / "tokenizer_config.json"
        if config.exists():
            try:
                tokenizer_class = json.loads(config.read_text()).get("tokenizer_class")
            except ValueError:
                tokenizer_class = None
            if tokenizer_class == "PreTrainedTokenizerFast":
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


class LazyTokenizer:
    """Loads the tokenizer on first use, so jobs given only token ids need none. A load failure is
    kept and raised again (as ``OSError``) on every use, so each text row reports it."""

    def __init__(self, path: str):
        self.path, self._tokenizer, self._error = path, None, None

    def get(self):
        if self._tokenizer is None and self._error is None:
            try:
                self._tokenizer = load_tokenizer(self.path)
            except Exception as exc:
                self._error = f"no tokenizer loaded from {self.path} ({exc})"
        if self._error:
            raise OSError(self._error)
        return self._tokenizer


class ScoringRequestError(InvariantInferError, ValueError):
    """A scoring request that cannot be turned into token ids; the message says why."""


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


def parse_request(record: dict, tokenizer: LazyTokenizer) -> tuple[list[int], int]:
    """(token ids, prompt length) of one scoring request: ``input_ids``, ``text``, ``prompt`` +
    ``completion`` (tokenized separately, no special tokens, ids concatenated) or ``prompt_ids`` +
    ``completion_ids``, besides an optional ``id``. Raises ``ScoringRequestError``."""
    fields = set(record) - {"id"}
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
