"""The serving engine: every request's tokens, sampled-token logprobs and prompt logprobs are
bitwise those of the same request alone, of ``model.generate`` and of ``score_sequences``, for any
arrival schedule, token budget, chunking, preemption and prefix-cache hit; for every family.
Comparisons are exact (torch.equal / ==)."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.engine.sampler as sampler_module
import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.engine_runs import run_schedule
from helpers.models import FAMILY_NAMES, MOE_FAMILY_NAMES, OWN_TEST_FAMILY_NAMES, load_model
from helpers.tokenizer import train_tokenizer
from invariant_infer import make_invariant, score_sequences
from invariant_infer.engine import Engine, RequestError, SamplingParams
from invariant_infer.generation.generate import seeded_sampling
from invariant_infer.model.families import text_config
from invariant_infer.model.padding import left_pad

pytestmark = pytest.mark.file_minutes(1.8)  # measured on 2 cores: start it early

NEW_TOKENS = 3


def prompts_for(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def request_params(i: int) -> SamplingParams:
    """Greedy and seeded sampling alternate; all ask for logprobs and prompt logprobs."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=40, top_p=0.9, seed=100 + i,
                          logprobs=2, prompt_logprobs=1, ignore_eos=True)


def assert_same(a, b):
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    assert a.prompt_logprobs == b.prompt_logprobs and a.prompt_top_logprobs == b.prompt_top_logprobs
    assert a.finish_reason == b.finish_reason


@pytest.fixture(scope="module")
def family_models(family_checkpoints):
    cache = {}

    def get(family, dtype=torch.bfloat16):
        if (family, dtype) not in cache:
            cache[family, dtype] = make_invariant(load_model(family_checkpoints(family), dtype))
        return cache[family, dtype]
    return get


@pytest.mark.fast_cells(ids=["qwen3_moe"])
@pytest.mark.parametrize("family", FAMILY_NAMES + MOE_FAMILY_NAMES + OWN_TEST_FAMILY_NAMES)
def test_any_schedule_equals_alone_generate_and_score(family_models, family):
    model = family_models(family)
    prompts = prompts_for(text_config(model.config).vocab_size, (9, 3, 14), seed=1)
    # Token budget 5 chunks every prefill and mixes chunks with decode tokens; the third request
    # arrives mid-decode; the latest sequence is preempted once and recomputed; decode-only steps are
    # padded to 4 rows (as CUDA-graph buckets would be).
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=5, decode_buckets=(4,))
    mixed = run_schedule(engine, prompts, request_params, arrivals=(0, 0, 3), preempt_at=(4,))
    assert engine.core.runner.padding_rows > 0 and engine.core.scheduler.num_preemptions > 0
    alone_engine = Engine(model)
    for i, prompt in enumerate(prompts):
        assert_same(mixed[i], alone_engine.generate([prompt], request_params(i))[0])
    # model.generate on the wrapped model (batch-invariant itself): the same tokens, the greedy requests
    # in one left-padded batch, the seeded one with the same seed and filters.
    for group in ([0, 2], [1]):
        params = request_params(group[0])
        kwargs = {}
        if params.temperature:
            kwargs["logits_processor"] = seeded_sampling([params.seed], params.temperature, params.top_k, params.top_p)
        ids, mask = left_pad([prompts[i] for i in group])
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=0, eos_token_id=None, **kwargs)
        assert [mixed[i].token_ids for i in group] == generated[:, ids.shape[1]:].tolist()
    # score_sequences over prompt + generated: prompt logprobs, then the decode logprobs.
    scored = score_sequences(model, [prompt + mixed[i].token_ids for i, prompt in enumerate(prompts)])
    for i in range(len(prompts)):
        assert torch.equal(torch.tensor(mixed[i].prompt_logprobs + mixed[i].logprobs, dtype=torch.float32),
                           scored[i].token_logprobs)


def _decode_step(model, prompts, bucket: int):
    """An engine whose sequences have their prompts in the cache, and its next step's (decode) chunks."""
    engine = Engine(model, decode_buckets=(bucket,))
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    chunks = engine.core.scheduler.schedule()
    assert [chunk.num_tokens for chunk in chunks] == [1] * len(prompts)
    return engine.core.runner, chunks


def padded_and_plain(model, prompts, bucket: int):
    runner, chunks = _decode_step(model, prompts, bucket)
    padded = runner.hidden_states(chunks)
    runner.decode_buckets = []
    plain = runner.hidden_states(chunks)
    assert runner.padding_rows == bucket - len(chunks)
    return padded, plain


def test_decode_padding_rows_do_not_change_real_rows(family_models):
    """A decode step padded to a bucket (rows on scratch pages): the real rows' hidden states are
    bitwise those of the unpadded step. (fp32: bf16 would round much of a reordering away.)"""
    model = family_models("qwen2", torch.float32)
    padded, plain = padded_and_plain(model, prompts_for(model.config.vocab_size, (9, 3, 14), seed=8), bucket=8)
    assert padded.shape == plain.shape == (3, model.config.hidden_size) and torch.equal(padded, plain)


def test_negative_control_padding_changes_an_m_dependent_linear(family_models, monkeypatch):
    """The same padding with projections that pick BLOCK_K by M (3 rows vs 8): the real rows change."""
    model = family_models("qwen2", torch.float32)
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    padded, plain = padded_and_plain(model, prompts_for(model.config.vocab_size, (9, 3, 14), seed=8), bucket=8)
    assert not torch.equal(padded, plain)


def test_engine_score_equals_score_sequences(family_models):
    model = family_models("qwen2")
    sequences = prompts_for(model.config.vocab_size, (12, 5, 30), seed=2)
    engine = Engine(model, max_num_batched_tokens=8)
    for a, b in zip(engine.score(sequences, [1, 2, 10]),
                    score_sequences(model, sequences, prompt_lengths=[1, 2, 10])):
        assert torch.equal(a.token_logprobs, b.token_logprobs) and a.greedy == b.greedy and a.digest == b.digest


@pytest.mark.heavy
def test_prefix_cache_hit_equals_miss(family_models):
    model = family_models("llama")
    engine = Engine(model, max_num_batched_tokens=64)
    page = engine.core.blocks.page_size
    shared = prompts_for(model.config.vocab_size, (2 * page + 5,), seed=3)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared[:page + 1]]
    params = SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True)
    first = engine.generate(prompts[:1], params)[0]
    hits_before = engine.core.blocks.prefix_hits
    cached = engine.generate(prompts, params)
    assert engine.core.blocks.prefix_hits - hits_before >= 2 * page + 2 * page + page  # full pages of each prompt
    no_cache = Engine(model, enable_prefix_caching=False).generate(prompts, params)
    assert_same(cached[0], first)
    for a, b in zip(cached, no_cache):
        assert_same(a, b)


@pytest.mark.heavy
def test_more_requests_than_pages_all_finish(family_models):
    model = family_models("qwen3")
    page_bytes = Engine(model, kv_cache_memory=1 << 20).page_bytes
    engine = Engine(model, max_num_seqs=8, kv_cache_memory=3 * page_bytes)  # 3 pages of 64 positions
    prompts = prompts_for(model.config.vocab_size, (60, 50, 40, 30, 20), seed=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.blocks.num_used == 0
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


BAD_REQUESTS = [
    ([], SamplingParams(), "empty prompt"),
    ([1, 99999], SamplingParams(), "outside the vocabulary"),
    ([1, 2], SamplingParams(max_tokens=10_000), "positions"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_k=-3), "top_k"),
    ([1, 2], SamplingParams(logprobs=21), "logprobs"),
    ([1, 2], SamplingParams(stop=["x"]), "tokenizer"),
    ("text", SamplingParams(), "tokenizer"),
]


def test_bad_requests_are_refused_and_the_engine_keeps_serving(family_models):
    engine = Engine(family_models("qwen2"))
    running = engine.add_request([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    for prompt, params, match in BAD_REQUESTS:
        with pytest.raises(RequestError, match=match):
            engine.add_request(prompt, params)
    assert list(engine.core.sequences) == [running]  # nothing of the refused requests stayed behind
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].request_id == running and outputs[-1].finish_reason == "length"
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_request_that_can_never_fit_is_refused_at_admission(family_models):
    model = family_models("qwen2")
    engine = Engine(model, kv_cache_memory=Engine(model, kv_cache_memory=1 << 20).page_bytes)  # one page
    with pytest.raises(RequestError, match="KV pages"):
        engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=10))


def test_an_exception_in_one_request_fails_only_that_request(family_models, monkeypatch):
    model = family_models("qwen2")
    real = sampler_module.seeded_scores_rows

    def failing(scores, seeds, *args, **kwargs):
        if 666 in seeds:
            raise RuntimeError("boom")
        return real(scores, seeds, *args, **kwargs)
    monkeypatch.setattr(sampler_module, "seeded_scores_rows", failing)
    prompts = prompts_for(model.config.vocab_size, (5, 6), seed=6)
    outputs = Engine(model).generate(prompts, [SamplingParams(max_tokens=3, temperature=1.0, seed=666),
                                               SamplingParams(max_tokens=3, ignore_eos=True)])
    assert outputs[0].finish_reason == "error" and "boom" in outputs[0].error
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 3


def test_abort_frees_pages(family_models):
    engine = Engine(family_models("qwen2"))
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.core.blocks.num_used > 0
    assert engine.abort(rid).finish_reason == "abort"
    assert engine.core.blocks.num_used == 0 and not engine.has_unfinished()


def test_negative_control_m_dependent_linear_changes_a_request_with_its_batch(family_models, monkeypatch):
    """The same schedule with projections that pick BLOCK_K by M: a request's results change with its
    batch-mates (here the 3-token prompt, whose prefill alone has M <= 4). fp32, as above."""
    model = family_models("qwen2", torch.float32)
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    prompts = prompts_for(model.config.vocab_size, (9, 3, 14), seed=1)
    params = SamplingParams(max_tokens=2, prompt_logprobs=0, ignore_eos=True)
    batched = Engine(model).generate(prompts, params)
    alone = [Engine(model).generate([p], params)[0] for p in prompts]
    assert any(a.prompt_logprobs != b.prompt_logprobs or a.logprobs != b.logprobs for a, b in zip(batched, alone))


def test_text_prompts_and_stop_strings(family_models, tmp_path):
    from transformers import AutoTokenizer
    train_tokenizer(tmp_path)  # 320 tokens, inside the model's vocabulary
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    engine = Engine(family_models("qwen2"), tokenizer)
    free = engine.generate(["the cat runs"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert free.prompt_token_ids == tokenizer.encode("the cat runs", add_special_tokens=False)
    assert free.text == tokenizer.decode(free.token_ids, skip_special_tokens=True) and free.text
    stop = free.text[len(free.text) // 2:][:3]
    stopped = engine.generate(["the cat runs"], SamplingParams(max_tokens=6, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert free.text.startswith(stopped.text) and stopped.token_ids == free.token_ids[:len(stopped.token_ids)]


def test_the_stock_baseline_gives_the_model_its_attention_back(family_checkpoints):
    import gc
    model = load_model(family_checkpoints("qwen2"), torch.float32)
    before = model.config._attn_implementation
    engine = Engine(model, kernels="stock")
    assert model.config._attn_implementation != before  # the engine's paged attention while it runs
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    del engine
    gc.collect()
    assert model.config._attn_implementation == before
