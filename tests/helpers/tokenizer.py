"""A byte-level BPE trained locally and saved beside a random checkpoint, as real checkpoints ship one."""
from __future__ import annotations

import numpy as np


BPE_WORDS = "the a model token batch score sequence invariant logits prompt completion cat dog runs fast".split()


def train_tokenizer(model_dir):
    """A byte-level BPE trained here and saved next to the model, as a real checkpoint ships one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(BPE_WORDS, size=12)) for _ in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(model_dir)


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def save_tokenizer(path) -> None:
    """The scoring tests' byte-level BPE, saved as a PreTrainedTokenizerFast with a chat template."""
    from transformers import PreTrainedTokenizerFast

    train_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
