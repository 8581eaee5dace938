"""The engine never samples a vision-language model's image or video placeholder tokens, in greedy, seeded
and repetition-penalty requests alike: on a model rigged so that the placeholders are the argmax
(``helpers.placeholders``) every request gets bitwise the tokens of the unrigged model, and its logprobs
stay those of the model's whole distribution (what TRL's training step computes). The control: the same
engine with nothing suppressed samples them."""
from __future__ import annotations

import pytest
import torch

from helpers.placeholders import PROMPTS, placeholder_models
from invariant_infer.engine import Engine, SamplingParams

PARAMS = [SamplingParams(max_tokens=3, ignore_eos=True),
          SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=3),
          SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, seed=5, repetition_penalty=1.3)]


@pytest.fixture(scope="module")
def models():
    return placeholder_models()


def test_engine_never_samples_placeholders(models):
    plain, rigged, placeholders = models
    engine = Engine(rigged)
    assert engine.core.suppressed_token_ids == placeholders
    outs = engine.generate(list(PROMPTS), PARAMS)
    assert not any(t in placeholders for out in outs for t in out.token_ids)
    assert [o.token_ids for o in outs] == [o.token_ids for o in Engine(plain).generate(list(PROMPTS), PARAMS)]
    # The greedy request's logprobs are of the rigged model's whole softmax: its scores of the same tokens.
    scored = engine.score([PROMPTS[0] + outs[0].token_ids], [len(PROMPTS[0])])[0]
    assert torch.equal(torch.tensor(outs[0].logprobs, dtype=torch.float32), scored.token_logprobs)


def test_engine_without_suppression_samples_placeholders(models):
    """The control: the rigged model's own picks are the placeholders."""
    _, rigged, placeholders = models
    engine = Engine(rigged)
    engine.core.suppressed_token_ids = ()
    outs = engine.generate(list(PROMPTS[:2]), PARAMS[0])
    assert outs[0].token_ids[0] == placeholders[0] and outs[1].token_ids[0] == placeholders[1]
