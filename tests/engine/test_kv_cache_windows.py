"""Sliding-window layers in the engine hold only their window's pages: a model whose layers are all
windowed runs ten windows of context in about three windows of KV pages whatever the token budget
(its prefill chunks shortened to the free pages), four such requests share four times that, and
Gemma 3 / gpt-oss run in their full layers' whole context plus their sliding layers' windows.
Every result is bitwise the request alone in a large cache (and ``model.generate``): freed pages
overwritten with NaN, or reused by other requests, never change a bit; prefix hits under windows
take only pages still held. Negative controls: chunks that do not shrink are refused the same
budget; without freeing, the same budget never runs the request; one page less is refused; a page
freed while its window still reads it poisons the request's logprobs with the NaN written over it."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.engine.kv_cache_managers as managers
from helpers.models import load_model
from invariant_infer import make_invariant
from invariant_infer.engine import Engine, RequestError, SamplingParams
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

WINDOW = 64        # one page on CPU (the kernel's KV block)
CHUNK = 64         # max_num_batched_tokens: a prefill chunk spans at most a page
CONTEXT = 10 * WINDOW
PARAMS = SamplingParams(max_tokens=4, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Mistral tiny with a window of 64 on every layer, 1024 positions."""
    config = random_config("mistral", "tiny", sliding_window=WINDOW, max_position_embeddings=1024)
    path = save_random_checkpoint(tmp_path_factory.mktemp("windowed"), config)
    return make_invariant(load_model(path, torch.float32))


def prompt_of(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def page_bytes(model) -> int:
    return Engine(model, kv_cache_memory=1 << 20).page_bytes


def alone(model, prompts) -> list:
    return [Engine(model, max_num_batched_tokens=CHUNK).generate([p], PARAMS)[0] for p in prompts]


def results(outputs) -> list:
    return [(o.token_ids, o.logprobs) for o in outputs]


@pytest.mark.heavy
def test_an_all_windowed_model_runs_ten_windows_in_three_windows_of_pages(windowed):
    """The default budget of 2048 tokens: the prompt's chunks shrink to the pages the window leaves
    free (the request alone runs in chunks of 64)."""
    prompt = prompt_of(windowed.config.vocab_size, CONTEXT - PARAMS.max_tokens, seed=0)
    engine = Engine(windowed, kv_cache_memory=3 * page_bytes(windowed))
    assert engine.core.blocks.num_pages == 3
    out = engine.generate([prompt], PARAMS)[0]
    assert results([out]) == results(alone(windowed, [prompt]))
    generated = windowed.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                                  pad_token_id=0)
    assert out.token_ids == generated[0, len(prompt):].tolist()
    assert engine.core.scheduler.num_preemptions == 0 and engine.core.blocks.num_used == 0


def test_negative_control_chunks_that_do_not_shrink_are_refused_the_same_budget(windowed):
    """Chunks shrinking to the free pages, the request is taken; a chunk of the whole 2048-token
    budget would hold the ten pages of the prompt at once, and the same budget refuses it."""
    prompt = prompt_of(windowed.config.vocab_size, CONTEXT - PARAMS.max_tokens, seed=0)
    engine = Engine(windowed, kv_cache_memory=3 * page_bytes(windowed))
    engine.abort(engine.add_request(prompt, PARAMS))
    engine.core.blocks.chunks_shrink = False
    with pytest.raises(RequestError, match="needs 10 KV pages; the cache has 3 in all"):
        engine.add_request(prompt, PARAMS)


@pytest.mark.heavy
def test_negative_control_without_freeing_the_same_budget_never_runs_the_request(windowed, monkeypatch):
    """Pages never freed (and no prefix cache to resume from): three pages hold three chunks, then
    the request preempts itself and starts over, forever."""
    monkeypatch.setattr(managers.SlidingWindowManager, "free_unneeded", managers.FullAttentionManager.free_unneeded)
    prompt = prompt_of(windowed.config.vocab_size, CONTEXT - PARAMS.max_tokens, seed=0)
    engine = Engine(windowed, max_num_batched_tokens=CHUNK, kv_cache_memory=3 * page_bytes(windowed),
                    enable_prefix_caching=False)
    engine.add_request(prompt, PARAMS)
    reached = 0
    for _ in range(6):
        engine.step()
        seq = next(iter(engine.core.sequences.values()))
        reached = max(reached, seq.num_computed)
    assert engine.has_unfinished() and seq.num_output_tokens == 0 and reached == 3 * CHUNK
    assert engine.core.scheduler.num_preemptions > 0


@pytest.mark.heavy
def test_four_windowed_requests_share_four_budgets_with_freed_pages_poisoned(windowed):
    """Every free page's K and V are NaN before each step: a freed page is never read."""
    prompts = [prompt_of(windowed.config.vocab_size, CONTEXT // 2 - PARAMS.max_tokens - 16 * i, seed=1 + i)
               for i in range(4)]  # five windows each (CI time): each needs five pages without freeing
    engine = poisoned(Engine(windowed, max_num_batched_tokens=CHUNK, kv_cache_memory=4 * 3 * page_bytes(windowed),
                             enable_prefix_caching=False))
    together = engine.generate(prompts, PARAMS)
    assert results(together) == results(alone(windowed, prompts))
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in together)


@pytest.mark.heavy
def test_negative_control_a_page_freed_while_its_window_reads_it_poisons_the_request(windowed, monkeypatch):
    """Freeing one page more than the window has left: the NaN written over it reaches the logprobs."""
    eager = managers.SlidingWindowManager.first_needed
    monkeypatch.setattr(managers.SlidingWindowManager, "first_needed", lambda self, position: eager(self, position) + 1)
    prompt = prompt_of(windowed.config.vocab_size, 3 * WINDOW, seed=1)
    engine = poisoned(Engine(windowed, max_num_batched_tokens=CHUNK, enable_prefix_caching=False))
    out = engine.generate([prompt], PARAMS)[0]
    monkeypatch.undo()
    assert results([out]) != results(alone(windowed, [prompt]))


def poisoned(engine):
    """The engine, every free page's K and V overwritten with NaN after each step."""
    core = engine.core
    caches = {id(t): t for t in core.runner.k_caches + core.runner.v_caches if t is not None}.values()
    step = core.step_deltas

    def poisoned_step():
        deltas = step()
        free = torch.tensor(list(core.blocks.pool.free), dtype=torch.long)
        for cache in caches:
            cache[free] = float("nan")
        return deltas
    core.step_deltas = poisoned_step
    return engine


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_sliding_and_full_layers_run_in_the_whole_context_plus_the_windows(family_checkpoints, family):
    """Tiny configs: one sliding and one full layer, window 24: a page group each. 300 tokens take 5
    full-attention pages and 2 windowed ones (the window and one token: chunks shrink to the free
    pages), where chunks of 64 tokens would hold 3."""
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    prompt = prompt_of(model.config.vocab_size, 300 - PARAMS.max_tokens, seed=5)
    engine = Engine(model, max_num_batched_tokens=CHUNK, kv_cache_memory=7 * page_bytes(model))
    blocks = engine.core.blocks
    assert blocks.num_pages == 7 and blocks.pages_to_run(300, CHUNK) == 7 and blocks.pages_needed(300, CHUNK) == 8
    assert results(engine.generate([prompt], PARAMS)) == results(alone(model, [prompt]))
    smaller = Engine(model, max_num_batched_tokens=CHUNK, kv_cache_memory=6 * page_bytes(model))
    with pytest.raises(RequestError, match="needs 7 KV pages"):
        smaller.generate([prompt], PARAMS)


@pytest.mark.heavy
def test_prefix_hits_take_only_window_pages_still_held(windowed):
    """A request, then one sharing its first three pages: in a large cache the second hits all
    three (the window's page before the hit is held); in three pages, the first request reused them,
    so the second recomputes. Both equal alone."""
    vocab = windowed.config.vocab_size
    first = prompt_of(vocab, 5 * WINDOW + 10, seed=7)
    second = first[:3 * WINDOW] + prompt_of(vocab, 20, seed=8)
    expected = results(alone(windowed, [first, second]))
    for pages, hits in ((64, 3 * WINDOW), (3, 0)):
        engine = Engine(windowed, max_num_batched_tokens=CHUNK, kv_cache_memory=pages * page_bytes(windowed))
        outputs = [engine.generate([first], PARAMS)[0]]
        before = engine.core.blocks.prefix_hits
        outputs.append(engine.generate([second], PARAMS)[0])
        assert engine.core.blocks.prefix_hits - before == hits
        assert results(outputs) == expected
