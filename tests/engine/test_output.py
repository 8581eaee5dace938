"""The engine's incremental detokenizer: after every token its text is exactly what decoding the
whole output gives, stop strings cut where searching the whole text cuts, and the decode work per
token does not grow with the output."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.tokenizer import BPE_WORDS, train_tokenizer
from invariant_infer.engine.output import INCOMPLETE, Detokenizer

MULTI_BYTE = ["é", "ß", "日本", "語", "🙂", "Ω", "ñandú", "€"]  # 2, 3 and 4 UTF-8 bytes a character


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("bpe")
    train_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|pad|>"]})
    return tokenizer


def random_text(rng, words: int) -> str:
    pieces = rng.choice(BPE_WORDS + MULTI_BYTE, size=words)
    return "".join(p + (" " if rng.random() < 0.7 else "") for p in pieces)


def random_outputs(tokenizer, rng, length: int) -> list[int]:
    """What a model may sample: encoded text with multi-byte characters, special tokens between,
    or any ids at all (lone bytes of a character, invalid UTF-8)."""
    if rng.random() < 0.3:
        return rng.integers(0, len(tokenizer), size=length).tolist()
    ids = tokenizer.encode(random_text(rng, length), add_special_tokens=False)[:length]
    for _ in range(int(rng.integers(0, 4))):
        ids.insert(int(rng.integers(0, len(ids) + 1)), int(rng.choice(tokenizer.all_special_ids)))
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_after_every_token_equals_the_whole_decode(tokenizer, skip_special_tokens):
    rng = np.random.default_rng(0)
    partial_characters = special_steps = 0
    for _ in range(150):
        ids = random_outputs(tokenizer, rng, int(rng.integers(1, 40)))
        detokenizer = Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        for i, token in enumerate(ids):
            whole = tokenizer.decode(ids[:i + 1], skip_special_tokens=skip_special_tokens)
            assert detokenizer.add(token) == whole, (ids[:i + 1], skip_special_tokens)
            partial_characters += whole.endswith(INCOMPLETE)
            special_steps += token in tokenizer.all_special_ids
    assert partial_characters > 50 and special_steps > 50  # the cases that need care did come up


def whole_text_stop(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(step, text) of the first stop, searching the whole decoded text after every token."""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
        if any(stop in text for stop in stops):
            return i, text[:min(text.index(stop) for stop in stops if stop in text)]
    return None


def test_stop_strings_cut_where_the_whole_text_search_cuts(tokenizer):
    rng = np.random.default_rng(1)
    spanning = stopped = 0
    for _ in range(200):
        ids = random_outputs(tokenizer, rng, int(rng.integers(2, 30)))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if len(text) < 2:
            continue
        stops = []
        for _ in range(int(rng.integers(1, 4))):
            start = int(rng.integers(0, len(text) - 1))
            stops.append(text[start:start + int(rng.integers(1, 7))])
        if rng.random() < 0.2:
            stops.append("never in the text \x00")
        token_texts = [tokenizer.decode([t], skip_special_tokens=True) for t in ids]
        spanning += any(all(stop not in piece for piece in token_texts) for stop in stops)
        expected = whole_text_stop(tokenizer, ids, stops)
        detokenizer, got = Detokenizer(tokenizer, stops), None
        for i, token in enumerate(ids):
            detokenizer.add(token)
            if detokenizer.cut_at_stop():
                got = (i, detokenizer.text)
                break
        assert got == expected, (ids, stops)
        stopped += got is not None
    assert spanning > 50 and stopped > 150


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.decoded_ids = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_work_per_token_does_not_grow_with_the_output(tokenizer):
    ids = tokenizer.encode(random_text(np.random.default_rng(2), 3000), add_special_tokens=False)[:2000]
    counting = CountingTokenizer(tokenizer)
    detokenizer = Detokenizer(counting, ["no such stop"])
    for token in ids:
        detokenizer.add(token)
        detokenizer.cut_at_stop()
    assert detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)
    # Decoding the whole output each token would decode len * (len + 1) / 2 = 2 001 000 ids.
    assert counting.decoded_ids < 10 * len(ids)


class CleanupTokenizer:
    """A decoder whose text is not additive over tokens: " ." becomes "." across a token boundary."""
    vocab = ["a", " ", ".", "b ", " .", "é"[0]]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids).replace(" .", ".")


def test_a_decoder_that_is_not_additive_still_gives_the_whole_decode():
    rng = np.random.default_rng(3)
    tokenizer = CleanupTokenizer()
    for _ in range(100):
        ids = rng.integers(0, len(tokenizer.vocab), size=int(rng.integers(1, 20))).tolist()
        detokenizer = Detokenizer(tokenizer, ["a."])
        for i, token in enumerate(ids):
            assert detokenizer.add(token) == tokenizer.decode(ids[:i + 1])
            if detokenizer.cut_at_stop():
                assert whole_text_stop(tokenizer, ids, ["a."]) == (i, detokenizer.text)
                break
        else:
            assert whole_text_stop(tokenizer, ids, ["a."]) is None
