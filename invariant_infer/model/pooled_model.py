"""A pooled model (an embedder, a classifier, a cross-encoder, a reward model) as one object: its
tokenizer, its task and what its outputs are, and one padded forward for any rows.

``forward_rows`` runs the rows in one padded batch of the invariant model, so each row's output has the
same bits whatever the batch, its order or its padding: an embedder's pooled embedding (before any
normalisation), or a head's logits. ``embeddings`` truncates (Matryoshka) and normalises them,
``activations`` turns logits into probabilities or scores; both work on each row alone.

    pooled = load_pooled_model(path)                 # invariant_infer.checkpoints.pooled_loading
    rows = [pooled.tokenize(text) for text in texts]
    vectors = pooled.embeddings(pooled.forward_rows(rows), dimensions=256)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from .pooling import POOLING_MODES, normalize, pool

POOLING_TASKS = ("embed", "classify", "score", "reward")


@dataclass(frozen=True)
class PooledInput:
    """One row: its token ids (special tokens included) and, where the tokenizer gives them, its token types."""
    input_ids: list[int]
    token_type_ids: list[int] | None = None


class PooledModel:
    """An invariant Hugging Face model (``model``, after ``make_invariant``) run for one pooling task.

    ``task``: one of ``POOLING_TASKS``. ``pooling_mode`` (embed only): a ``POOLING_MODES`` name;
    ``normalize``: whether ``embeddings`` L2-normalises. ``labels``: a head's labels in order (its
    ``id2label``), None for an embedder. ``max_length``: the longest row, in tokens, the model takes.
    ``matryoshka_dimensions``: None when the embedder is not Matryoshka; else the widths it may be
    truncated to (every width from 1 to ``dimensions`` where the config says ``is_matryoshka`` only).
    ``dimensions``: the output width (hidden size, or the number of labels). ``model`` may be None (a
    description for reading requests before any weight is loaded, with its ``config``: ``forward_rows``
    needs the model)."""

    def __init__(self, model, tokenizer, task: str, *, pooling_mode: str | None = None, normalize: bool = False,
                 labels: list[str] | None = None, max_length: int, matryoshka_dimensions: tuple[int, ...] | None = None,
                 dimensions: int, pad_token_id: int = 0, padding_side: str = "right", config=None):
        if task not in POOLING_TASKS:
            raise InvalidArgumentError(f"pooling task {task!r} is not one of {POOLING_TASKS}")
        if task == "embed" and pooling_mode not in POOLING_MODES:
            raise InvalidArgumentError(f"pooling mode {pooling_mode!r} is not one of {POOLING_MODES}")
        if padding_side not in ("left", "right"):
            raise InvalidArgumentError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.pooling_mode = pooling_mode if task == "embed" else None
        self.normalize = bool(normalize) if task == "embed" else False
        self.labels = None if task == "embed" else list(labels or [])
        self.max_length, self.dimensions = int(max_length), int(dimensions)
        self.matryoshka_dimensions = matryoshka_dimensions if task == "embed" else None
        self.pad_token_id, self.padding_side = int(pad_token_id), padding_side
        self.uses_token_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        self.config = config if config is not None else model.config
        self.vocab_size = self.config.vocab_size

    # ---- inputs -------------------------------------------------------------------------------------

    def _input(self, encoded) -> PooledInput:
        types = encoded.get("token_type_ids") if self.uses_token_types else None
        return PooledInput(list(encoded["input_ids"]), None if types is None else list(types))

    def tokenize(self, text: str) -> PooledInput:
        """``text``'s row, special tokens added as the tokenizer adds them; never truncated (``check_length``)."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"tokenize takes a string, not {type(text).__name__}")
        return self._input(self.tokenizer(text, add_special_tokens=True, truncation=False))

    def tokenize_pair(self, text_1: str, text_2: str) -> PooledInput:
        """A pair's row (a cross-encoder's query and document), as the tokenizer joins two texts."""
        if not isinstance(text_1, str) or not isinstance(text_2, str):
            raise InvalidArgumentError("tokenize_pair takes two strings")
        return self._input(self.tokenizer(text_1, text_2, add_special_tokens=True, truncation=False))

    def check_length(self, inp: PooledInput) -> None:
        """Refuse an empty row, or one longer than ``max_length``, by its length and the limit."""
        n = len(inp.input_ids)
        if n == 0:
            raise InvalidArgumentError("empty input: a row needs at least one token")
        if n > self.max_length:
            raise InvalidArgumentError(f"input of {n} tokens is longer than the model's maximum of "
                                       f"{self.max_length} tokens")
        if inp.token_type_ids is not None and len(inp.token_type_ids) != n:
            raise InvalidArgumentError(f"token_type_ids has {len(inp.token_type_ids)} entries for {n} tokens")

    # ---- the forward ------------------------------------------------------------------------------

    def _batch(self, inputs: list[PooledInput], device) -> dict[str, torch.Tensor]:
        width = max(len(inp.input_ids) for inp in inputs)
        ids = torch.full((len(inputs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids) if self.uses_token_types else None
        for row, inp in enumerate(inputs):
            n = len(inp.input_ids)
            span = slice(width - n, width) if self.padding_side == "left" else slice(0, n)
            ids[row, span] = torch.tensor(inp.input_ids, dtype=torch.long)
            mask[row, span] = 1
            if types is not None and inp.token_type_ids is not None:
                types[row, span] = torch.tensor(inp.token_type_ids, dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": mask}
        if types is not None:
            batch["token_type_ids"] = types
        return {name: value.to(device) for name, value in batch.items()}

    def forward_rows(self, inputs: list[PooledInput]) -> torch.Tensor:
        """[len(inputs), dimensions] float32 on CPU, from one padded forward: an embedder's pooled rows
        (before normalisation), a head's logits. Each row's bits do not depend on the others."""
        if not inputs:
            return torch.empty((0, self.dimensions), dtype=torch.float32)
        for inp in inputs:
            self.check_length(inp)
        device = next(self.model.parameters()).device
        batch = self._batch(inputs, device)
        with torch.no_grad():
            out = self.model(**batch)
            if self.task == "embed":
                rows = pool(out.last_hidden_state, batch["attention_mask"], self.pooling_mode)
            else:
                rows = out.logits
        return rows.float().cpu()

    # ---- outputs, each row alone ---------------------------------------------------------------------

    def embeddings(self, pooled: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
        """The embedding of each pooled row: its first ``dimensions`` values (Matryoshka models only), then
        L2-normalised when the model normalises (truncated first, as vLLM does)."""
        if self.task != "embed":
            raise InvalidArgumentError(f"embeddings: a {self.task} model gives scores, not embeddings")
        if dimensions is not None:
            self.check_dimensions(dimensions)
            pooled = pooled[:, :dimensions].contiguous()
        return normalize(pooled) if self.normalize else pooled

    def check_dimensions(self, dimensions: int) -> None:
        """Refuse a Matryoshka width the model does not take, and any width for a model that is not Matryoshka
        (as vLLM does)."""
        if type(dimensions) is not int:
            raise InvalidArgumentError(f"dimensions must be an integer, not {dimensions!r}")
        if self.matryoshka_dimensions is None:
            raise InvalidArgumentError(f"dimensions={dimensions}: this model is not a Matryoshka model; its "
                                       f"embeddings have {self.dimensions} dimensions")
        if not 1 <= dimensions <= self.dimensions or dimensions not in self.matryoshka_dimensions:
            allowed = (f"1 to {self.dimensions}" if len(self.matryoshka_dimensions) == self.dimensions
                       else ", ".join(map(str, self.matryoshka_dimensions)))
            raise InvalidArgumentError(f"dimensions={dimensions} is not supported by this model (supported: {allowed})")

    def activations(self, logits: torch.Tensor) -> torch.Tensor:
        """float64 [B, labels]: classify -> softmax over the labels; score -> sigmoid of one label (a
        cross-encoder's relevance), softmax over several; reward -> the logits themselves. Each row
        computed alone, in float64 arithmetic (``math``), so its bits never depend on its neighbours."""
        if self.task == "embed":
            raise InvalidArgumentError("activations: an embed model has no head; use embeddings")
        rows = logits.detach().double().cpu().tolist()
        if self.task == "reward":
            out = rows
        elif self.task == "score" and logits.shape[-1] == 1:
            out = [[_sigmoid(x) for x in row] for row in rows]
        else:
            out = [_softmax(row) for row in rows]
        return torch.tensor(out, dtype=torch.float64).reshape(logits.shape)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = math.fsum(exps)  # exactly rounded: no order to depend on
    return [e / total for e in exps]
