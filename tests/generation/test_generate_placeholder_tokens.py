"""``generate`` on a vision-language model never samples its image or video placeholder tokens, greedy or
seeded: the wrapped ``generate`` suppresses them (transformers' ``suppress_tokens``, row-local). On a model
rigged so that the placeholders are the argmax (``helpers.placeholders``) it gives bitwise the tokens of
the unrigged model; transformers' own ``generate`` on the rigged model (the control) samples them."""
from __future__ import annotations

import pytest
import torch

from helpers.placeholders import PROMPTS, placeholder_models
from invariant_infer.generation import seeded_sampling
from invariant_infer.model.padding import left_pad

SEEDS = [0, 1]


@pytest.fixture(scope="module")
def models():
    return placeholder_models()


def _generate(generate, model, seeded: bool, **options):
    ids, mask = left_pad(list(PROMPTS[:2]), 0, model.device)
    if seeded:
        options["logits_processor"] = seeded_sampling(SEEDS, temperature=1.0)
    out = generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, **options)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("seeded", [False, pytest.param(True, marks=pytest.mark.heavy)], ids=["greedy", "seeded"])
def test_generate_never_samples_placeholders(models, seeded):
    plain, rigged, placeholders = models
    got = _generate(rigged.generate, rigged, seeded)
    assert not torch.isin(got, torch.tensor(placeholders)).any()
    assert torch.equal(got, _generate(plain.generate, plain, seeded))
    if not seeded:  # a caller's own suppress_tokens are kept beside the placeholders
        first = int(got[0, 0])
        again = _generate(rigged.generate, rigged, seeded, suppress_tokens=[first])
        assert int(again[0, 0]) != first and not torch.isin(again, torch.tensor(placeholders)).any()
    # The control: transformers' generate on the rigged model, without the wrapper, samples a placeholder.
    unwrapped = _generate(lambda **kw: type(rigged).generate(rigged, **kw), rigged, seeded)
    assert torch.isin(unwrapped, torch.tensor(placeholders)).any()
