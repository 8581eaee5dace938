"""Scoring request files: rows of every request shape, bad lines with the error each must give."""
from __future__ import annotations

import json

import numpy as np

from .tokenizer import BPE_WORDS


def score_requests(count: int, seed: int = 0) -> list[dict]:
    """A mix of all four request shapes."""
    rng = np.random.default_rng(seed)
    text = lambda n: " ".join(rng.choice(BPE_WORDS, size=n))  # noqa: E731
    ids = lambda n: rng.integers(0, 512, size=n).tolist()  # noqa: E731
    rows = []
    for i in range(count):
        n = int(rng.integers(3, 24))
        kind = i % 4
        row = ({"input_ids": ids(n)} if kind == 0 else {"text": text(n)} if kind == 1
               else {"prompt": text(n), "completion": " " + text(3)} if kind == 2
               else {"prompt_ids": ids(n), "completion_ids": ids(4)})
        rows.append({"id": i if i % 2 else f"r{i}", **row})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


BAD_LINES = [
    ('{"id": "ok1", "input_ids": [1, 2, 3]}', None),
    ('{"id": "bad json", ', "malformed JSON"),
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"input_ids": [1, 2]}', "missing field 'id'"),
    ('{"id": "unknown", "input_ids": [1, 2], "extra": 1}', "unknown field"),
    ('{"id": "missing", "prompt": "the cat"}', "missing field(s) ['completion']"),
    ('{"id": "neither"}', "need exactly one of"),
    ('{"id": "conflict", "text": "the cat", "input_ids": [1, 2]}', "need exactly one of"),
    ('{"id": "empty", "input_ids": []}', "empty sequence"),
    ('{"id": "one token", "input_ids": [5]}', "nothing to score"),
    ('{"id": "empty prompt", "prompt_ids": [], "completion_ids": [1, 2]}', "empty prompt"),
    ('{"id": "empty completion", "prompt": "the cat", "completion": ""}', "nothing to score"),
    ('{"id": "vocab", "input_ids": [1, 512]}', "outside the vocabulary"),
    ('{"id": "negative", "input_ids": [1, -1]}', "outside the vocabulary"),
    ('{"id": "float", "input_ids": [1, 2.5]}', "list of integers"),
    ('{"id": "long", "input_ids": [%s]}' % ", ".join(["1"] * 513), "longer than the model's 512 positions"),
    ('{"id": [1], "input_ids": [1, 2]}', "id must be"),
    ('{"id": null, "input_ids": [1, 2]}', "id must be"),
    ('{"id": NaN, "input_ids": [1, 2]}', "malformed JSON"),
    ('{"id": "ok1", "input_ids": [4, 5]}', "duplicate id"),
    ("", None),  # blank lines are skipped
    ('{"id": 7, "text": "the cat runs fast"}', None),
    ('{"id": "ok2", "prompt": "the dog", "completion": " runs"}', None),
]
