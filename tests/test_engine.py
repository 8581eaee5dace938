"""The serving engine: every request's tokens, sampled-token logprobs and prompt logprobs are
bitwise those of the same request alone, of ``model.generate`` and of ``score_sequences``, for any
arrival schedule, token budget, chunking, preemption and prefix-cache hit; for every family.
Comparisons are exact (torch.equal / ==)."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.engine.engine as engine_module
from helpers import FAMILY_NAMES, load_model
from invariant_infer import make_invariant, score_sequences
from invariant_infer.engine import Engine, RequestError, SamplingParams
from invariant_infer.generation import seeded_sampling
from invariant_infer.random_checkpoints import random_config, save_random_checkpoint

NEW_TOKENS = 4


def prompts_for(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def request_params(i: int) -> SamplingParams:
    """Greedy and seeded sampling alternate; all ask for logprobs and prompt logprobs."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=40, top_p=0.9, seed=100 + i,
                          logprobs=2, prompt_logprobs=1, ignore_eos=True)


def run_schedule(engine: Engine, prompts, arrivals, preempt_at=()) -> dict[int, object]:
    """Add prompt i at step arrivals[i]; optionally preempt the latest sequence before given steps."""
    outputs, step, ids = {}, 0, {}
    while len(outputs) < len(prompts):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                ids[engine.add_request(prompts[i], request_params(i))] = i
        if step in preempt_at:
            engine.scheduler.preempt_latest()
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
        step += 1
        assert step < 500, "the engine stopped making progress"
    return outputs


def assert_same(a, b):
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    assert a.prompt_logprobs == b.prompt_logprobs and a.prompt_top_logprobs == b.prompt_top_logprobs
    assert a.finish_reason == b.finish_reason


@pytest.fixture(scope="module")
def family_models(family_checkpoints):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_invariant(load_model(family_checkpoints(family), torch.bfloat16))
        return cache[family]
    return get


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_any_schedule_equals_alone_generate_and_score(family_models, family):
    model = family_models(family)
    prompts = prompts_for(model.config.vocab_size, (9, 3, 14), seed=1)
    # Token budget 5 chunks every prefill and mixes chunks with decode tokens; the third request
    # arrives mid-decode; the latest sequence is preempted once and recomputed.
    mixed = run_schedule(Engine(model, max_num_seqs=3, max_num_batched_tokens=5), prompts, arrivals=(0, 0, 3),
                         preempt_at=(4,))
    for i, prompt in enumerate(prompts):
        alone = Engine(model).generate([prompt], request_params(i))[0]
        assert_same(mixed[i], alone)
        # model.generate on the wrapped model: same tokens (seeded: same seed, same filters).
        params = request_params(i)
        kwargs = {}
        if params.temperature:
            kwargs["logits_processor"] = seeded_sampling([params.seed], params.temperature, params.top_k, params.top_p)
        ids = torch.tensor([prompt])
        generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
        assert mixed[i].token_ids == generated[0, len(prompt):].tolist()
        # score_sequences over prompt + generated: prompt logprobs, then the decode logprobs.
        scored = score_sequences(model, [prompt + mixed[i].token_ids])[0].token_logprobs
        assert torch.equal(torch.tensor(mixed[i].prompt_logprobs + mixed[i].logprobs, dtype=torch.float32), scored)


def test_engine_score_equals_score_sequences(family_models):
    model = family_models("qwen2")
    sequences = prompts_for(model.config.vocab_size, (12, 5, 30), seed=2)
    engine = Engine(model, max_num_batched_tokens=8)
    for a, b in zip(engine.score(sequences, [1, 2, 10]),
                    score_sequences(model, sequences, prompt_lengths=[1, 2, 10])):
        assert torch.equal(a.token_logprobs, b.token_logprobs) and a.greedy == b.greedy and a.digest == b.digest


def test_prefix_cache_hit_equals_miss(family_models):
    model = family_models("llama")
    engine = Engine(model, max_num_batched_tokens=64)
    page = engine.blocks.page_size
    shared = prompts_for(model.config.vocab_size, (2 * page + 5,), seed=3)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared[:page + 1]]
    params = SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True)
    first = engine.generate(prompts[:1], params)[0]
    hits_before = engine.blocks.prefix_hits
    cached = engine.generate(prompts, params)
    assert engine.blocks.prefix_hits - hits_before >= 2 * page + 2 * page + page  # full pages of each prompt
    no_cache = Engine(model, enable_prefix_caching=False).generate(prompts, params)
    assert_same(cached[0], first)
    for a, b in zip(cached, no_cache):
        assert_same(a, b)


def test_more_requests_than_pages_all_finish(family_models):
    model = family_models("qwen3")
    page_bytes = Engine(model, kv_cache_memory=1 << 20).page_bytes
    engine = Engine(model, max_num_seqs=8, kv_cache_memory=3 * page_bytes)  # 3 pages of 64 positions
    prompts = prompts_for(model.config.vocab_size, (60, 50, 40, 30, 20), seed=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_used == 0
    alone = Engine(model).generate(prompts, params)
    for a, b in zip(outputs, alone):
        assert_same(a, b)


def test_unseeded_request_returns_its_seed_and_replays(family_models):
    model = family_models("mistral")
    prompt = prompts_for(model.config.vocab_size, (7,), seed=5)[0]
    first = Engine(model).generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))[0]
    replay = Engine(model).generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=first.seed,
                                                             ignore_eos=True))[0]
    assert 0 <= first.seed < 2 ** 63 and replay.token_ids == first.token_ids and replay.logprobs == first.logprobs


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty prompt"),
    ([1, 99999], SamplingParams(), "outside the vocabulary"),
    ([1, 2], SamplingParams(max_tokens=10_000), "positions"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_k=-3), "top_k"),
    ([1, 2], SamplingParams(logprobs=21), "logprobs"),
    ([1, 2], SamplingParams(stop=["x"]), "tokenizer"),
    ("text", SamplingParams(), "tokenizer"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(family_models, prompt, params, match):
    engine = Engine(family_models("qwen2"))
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, params)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_request_that_can_never_fit_is_refused_at_admission(family_models):
    model = family_models("qwen2")
    engine = Engine(model, kv_cache_memory=Engine(model, kv_cache_memory=1 << 20).page_bytes)  # one page
    with pytest.raises(RequestError, match="KV pages"):
        engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=10))


def test_an_exception_in_one_request_fails_only_that_request(family_models, monkeypatch):
    model = family_models("qwen2")
    real = engine_module.sample_next_token

    def failing(scores, tokens, *, seed, **kwargs):
        if seed == 666:
            raise RuntimeError("boom")
        return real(scores, tokens, seed=seed, **kwargs)
    monkeypatch.setattr(engine_module, "sample_next_token", failing)
    prompts = prompts_for(model.config.vocab_size, (5, 6), seed=6)
    outputs = Engine(model).generate(prompts, [SamplingParams(max_tokens=3, temperature=1.0, seed=666),
                                               SamplingParams(max_tokens=3, ignore_eos=True)])
    assert outputs[0].finish_reason == "error" and "boom" in outputs[0].error
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 3


def test_abort_frees_pages(family_models):
    engine = Engine(family_models("qwen2"))
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.blocks.num_used > 0
    assert engine.abort(rid).finish_reason == "abort"
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()


@pytest.mark.slow
def test_negative_control_stock_engine_differs_at_real_widths(tmp_path):
    """The same engine with stock kernels: a request's logprobs change with its batch-mates. (On
    this CPU, stock fp32 linear layers round differently at M = 1 than at M > 1, so decode steps
    alone and in a batch differ; bf16 happens to be M-invariant here.)"""
    config = random_config("qwen2", "qwen2.5-1.5b", num_hidden_layers=1, vocab_size=2048, max_position_embeddings=1024)
    model = load_model(save_random_checkpoint(tmp_path / "m", config, seed=3), torch.float32)
    prompts = prompts_for(config.vocab_size, (33, 1, 20, 7), seed=7)
    params = SamplingParams(max_tokens=3, prompt_logprobs=0, ignore_eos=True)
    batched = Engine(model, kernels="stock", max_num_batched_tokens=64).generate(prompts, params)
    alone = [Engine(model, kernels="stock").generate([p], params)[0] for p in prompts]
    assert any(a.prompt_logprobs != b.prompt_logprobs or a.logprobs != b.logprobs for a, b in zip(batched, alone))


def test_text_prompts_and_stop_strings(tmp_path):
    from transformers import AutoTokenizer

    from helpers import train_tokenizer
    path = save_random_checkpoint(tmp_path / "m", random_config("qwen2", "tiny"), seed=4)
    train_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = make_invariant(load_model(path, torch.bfloat16))
    engine = Engine(model, tokenizer)
    free = engine.generate(["the cat runs"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert free.prompt_token_ids == tokenizer.encode("the cat runs", add_special_tokens=False)
    assert free.text == tokenizer.decode(free.token_ids, skip_special_tokens=True) and free.text
    stop = free.text[len(free.text) // 2:][:3]
    stopped = engine.generate(["the cat runs"], SamplingParams(max_tokens=6, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert free.text.startswith(stopped.text) and stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
