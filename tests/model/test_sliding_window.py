"""Sliding-window attention in the families that configure it, one of each way: Mistral's
``sliding_window`` on every layer (Mixtral's is the same), and Qwen2's ``use_sliding_window`` layers
past ``max_window_layers`` (Qwen3's and the Qwen MoE families' are the same): a window of
24 keys, prompts of 70-100 tokens. Each row is bitwise itself alone in any padded batch (left,
right, ``inputs_embeds``) and packed; logits are within fp32 tolerance of stock float64, which the
same model with a window one key longer or shorter misses; ``generate`` decodes past the window
with transformers' dynamic (it keeps the last 23 keys) and static sliding caches, each step
bitwise one forward over the prefix, each row bitwise alone; the engine's requests equal alone
under a cramped budget with prefix hits. Logit softcapping (``softcap``) is refused, never
dropped."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening

from helpers.engine_runs import run_schedule
from helpers.models import batch_mismatches, load_model, make_samples
from invariant_infer import NonInvariantInputError, make_invariant
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model.attention import invariant_attention
from invariant_infer.model.families import text_config
from invariant_infer.model.padding import left_pad
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

WINDOW = 24
# The families' ways to configure windows; Qwen's layers past max_window_layers (here 1 of 2) slide.
QWEN_WINDOWS = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
WINDOWS = {"mistral": dict(sliding_window=WINDOW), "qwen2": QWEN_WINDOWS}
LENGTHS = (9, 1, 100, 5)  # 100: tiles whose windows start past the first 64-key block
FP32_TOLERANCE = 1e-5  # max |logit - stock float64's|; measured 2.6e-7 (mistral)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}

    def get(family: str):
        if family not in paths:
            paths[family] = save_random_checkpoint(tmp_path_factory.mktemp(f"window-{family}"),
                                                   random_config(family, "tiny", **WINDOWS[family]), seed=1)
        return paths[family]
    return get


@pytest.mark.fast_cells(ids=["mistral"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])  # every layer windowed; windowed layer types
def test_rows_equal_alone_in_any_batch_and_packed(checkpoints, family):
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoints(family), torch.bfloat16)),
                                                     LENGTHS)


def assert_rows_equal_alone_in_any_batch_and_packed(model, lengths) -> None:
    samples = make_samples(text_config(model.config).vocab_size, lengths)
    with torch.no_grad():
        assert batch_mismatches(model, samples) == []
        batch = DataCollatorWithFlattening()([{"input_ids": s.tolist()} for s in samples])
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        for sample, a, b in zip(samples, bounds, bounds[1:]):
            assert torch.equal(packed[a:b], model(input_ids=sample[None]).logits[0])


@pytest.mark.fast_cells(ids=["mistral"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_accuracy_against_float64_and_a_window_off_by_one_misses_it(checkpoints, family):
    stock = load_model(checkpoints(family), torch.float32)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(text_config(model.config).vocab_size, (100,))[0][None]

    def error(window):
        reference = copy.deepcopy(stock).double()
        reference.config.sliding_window = window  # every layer reads it at call time
        with torch.no_grad():
            return (model(ids).logits.double() - reference(ids).logits).abs().max().item()
    assert error(WINDOW) < FP32_TOLERANCE
    assert error(WINDOW + 1) > 100 * FP32_TOLERANCE and error(WINDOW - 1) > 100 * FP32_TOLERANCE


@pytest.mark.fast_cells(ids=["dynamic"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_past_the_window_equals_prefill_and_alone(checkpoints, cache):
    assert_generate_past_the_window_equals_prefill_and_alone(
        make_invariant(load_model(checkpoints("mistral"), torch.bfloat16)), cache, new_tokens=10)


def assert_generate_past_the_window_equals_prefill_and_alone(model, cache: str, new_tokens: int,
                                                             lengths=(70, 5, 30)) -> None:
    """Greedy ``generate`` of prompts of ``lengths`` tokens, left-padded together: each row's
    tokens and scores are those of the prompt alone, and each step's logits one forward's."""
    prompts = [s.tolist() for s in make_samples(text_config(model.config).vocab_size, lengths)]
    options = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                   return_dict_in_generate=True, cache_implementation=cache)
    ids, mask = left_pad(prompts)
    batch = model.generate(input_ids=ids, attention_mask=mask, **options)
    for row, prompt in enumerate(prompts):
        alone = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                               dtype=torch.long), **options)
        assert torch.equal(batch.sequences[row, -new_tokens:], alone.sequences[0, -new_tokens:])
        assert all(torch.equal(batch.scores[t][row], alone.scores[t][0]) for t in range(new_tokens))
        with torch.no_grad():  # each step's logits: one forward over its whole prefix
            full = model(alone.sequences[:, :-1]).logits[0, len(prompt) - 1:]
        assert all(torch.equal(alone.scores[t][0], full[t].float()) for t in range(new_tokens))


@pytest.mark.heavy  # the fast tier checks the paged window in tests/kernels/test_attention_window.py
def test_engine_requests_equal_alone_with_prefix_hits(checkpoints):
    assert_engine_requests_equal_alone_with_prefix_hits(
        make_invariant(load_model(checkpoints("mistral"), torch.bfloat16)), new_tokens=5,
        extra_prompts=[list(range(40, 110))])


def assert_engine_requests_equal_alone_with_prefix_hits(model, new_tokens: int, extra_prompts=(),
                                                         alone_prompt_logprobs: bool = False) -> None:
    """Two prompts sharing a 130-token prefix (two pages of 64 on CPU) and a short one, in an engine
    of 2 sequences and 13 tokens a step, the latest sequence preempted twice (recomputed from the
    pages the cache still holds): prefix hits, and each request's outputs those alone
    (``alone_prompt_logprobs``: alone with prompt logprobs, which compute the whole prompt)."""
    shared = make_samples(text_config(model.config).vocab_size, (130,), seed=3)[0].tolist()
    prompts = [shared + [7, 8], [5, 6, 7], shared + [9], *extra_prompts]
    params = SamplingParams(max_tokens=new_tokens, logprobs=1, ignore_eos=True)
    alone_params = SamplingParams(max_tokens=new_tokens, logprobs=1, ignore_eos=True,
                                  prompt_logprobs=1 if alone_prompt_logprobs else None)
    alone = [Engine(model).generate([prompt], alone_params)[0] for prompt in prompts]
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=13)
    outputs = run_schedule(engine, prompts, lambda i: params, arrivals=(0,) * len(prompts), preempt_at=(6, 14))
    mixed = [outputs[i] for i in range(len(prompts))]
    assert engine.core.blocks.prefix_hits > 0 and engine.core.scheduler.num_preemptions == 2
    assert all(len(o.token_ids) == new_tokens for o in mixed)
    assert [(o.token_ids, o.logprobs) for o in mixed] == [(o.token_ids, o.logprobs) for o in alone]


def test_softcapping_is_refused_by_name():
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(NonInvariantInputError, match="softcapping"):
        invariant_attention(None, q, q[:, :1], q[:, :1], None, softcap=50.0)
