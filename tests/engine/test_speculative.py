"""Speculative decoding changes no bit: with it on, every request's token_ids, logprobs and top
logprobs are bitwise those of plain decoding, greedy and seeded, for n-gram and draft-model
proposals, in a busy engine (chunked prefill, preemption, plain requests alongside) and over prefix
pages written while speculating.
Comparisons are exact; the negative control is a verify forward whose linear configuration depends
on its row count, which the same comparison catches."""
from __future__ import annotations

import math

import pytest
import torch

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.models import (FAMILY_NAMES, GLM4_MOE_FAMILY_NAMES, LATENT_ATTENTION_FAMILY_NAMES, MOE_FAMILY_NAMES,
                            load_model)
from invariant_infer import make_invariant
from invariant_infer.engine import Engine, RequestError, SamplingParams
from invariant_infer.engine.proposers import prompt_lookup
from invariant_infer.testing.random_checkpoints import qwen2_config, random_model

pytestmark = pytest.mark.file_minutes(1.2)  # measured on 2 cores: start it early

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models(tied_checkpoint):
    """The 1-layer tiny Qwen2 (tied embeddings) in the dtype asked for: cheap enough to decode a lot."""
    cache = {}

    def get(dtype=torch.bfloat16):
        if dtype not in cache:
            cache[dtype] = make_invariant(load_model(tied_checkpoint, dtype))
        return cache[dtype]
    return get


def prompts_for(vocab: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def busy_requests(vocab: int, page_size: int):
    """Two prompts that cross a page while decoding (preemption in a small cache) and two short ones:
    greedy with top logprobs, seeded sampling with filters and a repetition penalty, a plain request
    that does not speculate, and seeded sampling with processed logprobs and prompt logprobs."""
    prompts = prompts_for(vocab, (page_size - 9, page_size - 14, 8, 6), seed=11)
    params = [SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=40, top_p=0.9, seed=7, logprobs=1,
                             repetition_penalty=1.1, ignore_eos=True),
              SamplingParams(max_tokens=NEW_TOKENS, logprobs=1, ignore_eos=True, speculative=False),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, seed=9, logprobs_mode="processed_logprobs",
                             prompt_logprobs=1, ignore_eos=True)]
    return prompts, params


def run_busy(engine: Engine, prompts, params, arrivals=(0, 0, 1, 4)):
    """Requests arrive at the given steps; returns their finished outputs in order."""
    ids, outputs, step = {}, {}, 0
    while len(outputs) < len(prompts):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
        step += 1
        assert step < 300, "the engine stopped making progress"
    assert engine.core.blocks.num_used == 0
    return [outputs[i] for i in range(len(prompts))]


def assert_same(a, b):
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    assert a.prompt_logprobs == b.prompt_logprobs and a.finish_reason == b.finish_reason


def counting_forwards(engine: Engine) -> list[int]:
    count, forward = [0], engine.core.runner.forward

    def counted(inputs):
        count[0] += 1
        return forward(inputs)
    engine.core.runner.forward = counted
    return count


def busy_engine(model, speculative=None) -> Engine:
    """Token budget 24 (chunked prefill, verify chunks beside prefill chunks) and a 3-page cache, too
    small for the four requests at once (preemption)."""
    page_bytes = Engine(model, kv_cache_memory=1 << 20).page_bytes
    return Engine(model, max_num_batched_tokens=24, kv_cache_memory=3 * page_bytes,
                  speculative=speculative)


@pytest.fixture(scope="module")
def plain_busy(models):
    model = models()
    engine = busy_engine(model)
    prompts, params = busy_requests(model.config.vocab_size, engine.core.blocks.page_size)
    return prompts, params, run_busy(engine, prompts, params)


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 8), ("draft_model", 2)])
def test_speculation_in_a_busy_engine_equals_plain_decoding(models, plain_busy, method, k):
    model = models()
    prompts, params, plain = plain_busy
    config = dict(method=method, num_speculative_tokens=k)
    if method == "draft_model":  # the target itself: greedy proposals are accepted, sampled ones mostly not
        config["model"] = model
    else:
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    engine = busy_engine(model, config)
    outputs = run_busy(engine, prompts, params)
    for a, b in zip(outputs, plain):
        assert_same(a, b)
    stats = engine.core.speculative.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens  # both kinds
    assert engine.core.scheduler.num_preemptions > 0


# Every family in bf16, and qwen2 in fp32 (heavy tier). In the fast tier the busy-engine test above
# verifies through tiny Qwen2's forward; every family's multi-row decode forward is in test_engine's
# schedules, whose chunks continue after cached pages as a verify chunk does.
FAMILY_CELLS = [pytest.param(family, torch.bfloat16, id=f"{family}-bfloat16")
                for family in FAMILY_NAMES + MOE_FAMILY_NAMES + GLM4_MOE_FAMILY_NAMES + LATENT_ATTENTION_FAMILY_NAMES]
FAMILY_CELLS.append(pytest.param("qwen2", torch.float32, id="qwen2-float32"))


@pytest.mark.heavy
@pytest.mark.parametrize("family, dtype", FAMILY_CELLS)
def test_families_speculate_bitwise(family_checkpoints, family, dtype):
    """Dense and MoE families in bf16, and one in fp32: greedy and seeded requests side by side, the
    model its own draft (greedy proposals: accepted for the greedy request, mostly rejected for the
    seeded one), equal plain decoding."""
    model = make_invariant(load_model(family_checkpoints(family), dtype))
    prompts = [prompts_for(model.config.vocab_size, (9,), seed=15)[0], [7, 8, 9]]
    params = [SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=5, logprobs=1, ignore_eos=True)]
    plain = Engine(model, kv_cache_memory=1 << 20).generate(prompts, params)
    engine = Engine(model, kv_cache_memory=1 << 20,
                    speculative={"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    for a, b in zip(engine.generate(prompts, params), plain):
        assert_same(a, b)
    stats = engine.core.speculative.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_draft_equal_to_the_target_accepts_every_greedy_proposal(models):
    model, k, n = models(), 3, 13
    prompt = prompts_for(model.config.vocab_size, (7,), seed=12)[0]
    params = SamplingParams(max_tokens=n, logprobs=1, ignore_eos=True)
    plain = Engine(model).generate([prompt], params)[0]
    engine = Engine(model, speculative={"method": "draft_model", "model": model, "num_speculative_tokens": k})
    forwards = counting_forwards(engine)
    out = engine.generate([prompt], params)[0]
    assert_same(out, plain)
    stats = engine.core.speculative.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens == n - 1 - stats.num_drafts
    assert forwards[0] == 1 + math.ceil((n - 1) / (k + 1))  # the prefill, then k + 1 tokens a forward
    assert engine.core.speculative.proposer.blocks.num_used == 0  # its copy's pages freed once it finished


def test_prefix_pages_written_while_speculating_serve_later_requests_bitwise(models):
    """A request speculates past a page; a later one whose prompt is its prompt and output hits those
    pages, and gets what it gets with no prefix cache: no registered page holds a rejected token."""
    model = models()
    engine = Engine(model, speculative={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 2})
    page = engine.core.blocks.page_size
    prompt = prompts_for(model.config.vocab_size, (14,), seed=13)[0] * 4  # proposals the model rejects
    assert len(prompt) < page
    first = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert engine.core.speculative.stats.num_draft_tokens > engine.core.speculative.stats.num_accepted_tokens > 0
    follow = prompt + first.token_ids[:-1]
    params = SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True)
    hits = engine.core.blocks.prefix_hits
    cached = engine.generate([follow], params)[0]
    assert engine.core.blocks.prefix_hits - hits == page
    assert_same(cached, Engine(model, enable_prefix_caching=False).generate([follow], params)[0])


def test_abort_mid_speculation_frees_every_page(models):
    model = models()
    engine = Engine(model, speculative={"method": "draft_model", "model": model, "num_speculative_tokens": 2})
    rid = engine.add_request(prompts_for(model.config.vocab_size, (6,), seed=14)[0],
                             SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.speculative.stats.num_drafts > 0 and engine.core.speculative.proposer.blocks.num_used > 0
    assert engine.abort(rid).finish_reason == "abort"
    assert engine.core.blocks.num_used == 0 and engine.core.speculative.proposer.blocks.num_used == 0  # at once
    assert engine.step() == []


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_negative_control_a_row_count_dependent_verify_changes_the_output(monkeypatch):
    """Projections that pick BLOCK_K by M: a verify forward of k + 1 = 9 rows takes another config than
    a decode step's 1 row, and the comparison above catches it; with the engine's own projections
    the same comparison holds. fp32: bf16 would round much away."""
    model = make_invariant(random_model(qwen2_config("tiny", num_hidden_layers=1), seed=3, dtype=torch.float32))
    prompts = [[202, 260, 238, 38, 35, 85, 208], [5, 6, 7]]
    params = SamplingParams(max_tokens=10, logprobs=5, ignore_eos=True)
    speculative = {"method": "draft_model", "model": model, "num_speculative_tokens": 8}

    def differ() -> bool:
        plain = Engine(model, kv_cache_memory=1 << 20).generate(prompts, params)
        engine = Engine(model, kv_cache_memory=1 << 20, speculative=speculative)
        spec = engine.generate(prompts, params)
        assert engine.core.speculative.stats.num_accepted_tokens > 0
        return any(a.logprobs != b.logprobs or a.top_logprobs != b.top_logprobs for a, b in zip(plain, spec))
    assert not differ()
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    assert differ()


def test_prompt_lookup_proposes_what_followed_a_match():
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert prompt_lookup([1, 2, 3, 9, 5, 2, 3], 3, 2, 3) == [9, 5, 2]   # n = 3 misses, n = 2 hits
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 5, 1, 3) == [9, 1, 2, 3, 7]  # the latest is short
    assert prompt_lookup([4, 5, 6, 7], 3, 1, 3) == []
    assert prompt_lookup([5, 5, 5, 5], 4, 1, 1) == [5, 5, 5]


BAD_CONFIGS = [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 64}, "must fit in max_num_batched_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "min <= max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance": "rejection"}, "not implemented"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, "unknown keys"),
    ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
]


def test_bad_speculative_configs_are_refused_with_the_reason(models):
    model = models()
    for config, match in BAD_CONFIGS:
        with pytest.raises(ValueError, match=match):
            Engine(model, max_num_batched_tokens=32, kv_cache_memory=1 << 20, speculative=config)
    other_vocab = random_model(qwen2_config("tiny", vocab_size=384, num_hidden_layers=1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(model, kv_cache_memory=1 << 20,
               speculative={"method": "draft_model", "model": other_vocab, "num_speculative_tokens": 2})
    unwrapped = random_model(qwen2_config("tiny", num_hidden_layers=1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exact only with kernels='invariant'"):
        Engine(unwrapped, kernels="stock", kv_cache_memory=1 << 20,
               speculative={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(RequestError, match="speculative must be a bool"):
        Engine(model, kv_cache_memory=1 << 20).add_request([1, 2], SamplingParams(speculative="no"))
