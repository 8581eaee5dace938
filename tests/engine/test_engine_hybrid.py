"""The engine on hybrid models (Gated DeltaNet layers beside gated attention): each request's tokens,
logprobs and prompt logprobs are bitwise those of the request alone, of ``model.generate`` and of
``score_sequences``, whatever the token budget (prefill chunks cut before, at and past the scan's
chunk boundary at 64), arrivals mid-decode, preemption, decode steps padded to a bucket, and a
sequence's state slot reused by a later request; a prefix-cache hit restores the state a miss
computes. Negative controls: a scan chunk chosen by the step's batch, a step that forgets the
unfinished chunk's rows, and a hit without its saved state give other bits. What the engine does
not run yet with these layers is refused by name."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.engine.linear_state_slots as linear_state_slots
import invariant_infer.model.linear_attention as linear_attention
from helpers.engine_runs import run_schedule
from helpers.models import load_model
from invariant_infer import UnsupportedModelError, make_invariant, score_sequences
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.kernels import gated_delta_rule
from invariant_infer.model.padding import left_pad

pytestmark = pytest.mark.file_minutes(1.5)  # measured on 2 cores: start it early

NEW_TOKENS = 3
LENGTHS = (66, 3, 20)  # the first crosses the chunk boundary during prefill, and decodes past it


def prompts_for(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def params_for(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=40, seed=100 + i, logprobs=2,
                          prompt_logprobs=1, ignore_eos=True)


def same(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
            and a.prompt_logprobs == b.prompt_logprobs and a.prompt_top_logprobs == b.prompt_top_logprobs)


@pytest.fixture(scope="module")
def hybrid_models(family_checkpoints):
    cache = {}

    def get(family, dtype=torch.float32):
        if (family, dtype) not in cache:
            cache[family, dtype] = make_invariant(load_model(family_checkpoints(family), dtype))
        return cache[family, dtype]
    return get


def mixed_run(model, budget: int) -> dict:
    """Two sequences at most (the third reuses a finished one's state slot), the third arriving
    mid-prefill, the latest admitted preempted at step 1, decode-only steps padded to 4 rows."""
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=budget, decode_buckets=(4,))
    outputs = run_schedule(engine, prompts_for(model.config.vocab_size), params_for, arrivals=(0, 0, 2),
                           preempt_at=(1,))
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.runner.padding_rows > 0
    return outputs


# 200: the 66-token prompt is cut at 64 (prefix caching's boundary). The MoE hybrids run one budget
# each (their Gated DeltaNet layers are the dense one's; CI time).
@pytest.mark.fast_cells(ids=["qwen3_5_text-7"])
@pytest.mark.parametrize("family, budget", [("qwen3_5_text", 7), ("qwen3_5_text", 200), ("qwen3_5_moe_text", 200),
                                            ("qwen3_next", 7)], ids=lambda v: str(v))
def test_any_schedule_equals_alone_generate_and_score(hybrid_models, family, budget):
    model = hybrid_models(family)
    prompts = prompts_for(model.config.vocab_size)
    mixed = mixed_run(model, budget)
    alone = Engine(model)
    for i, prompt in enumerate(prompts):
        assert same(mixed[i], alone.generate([prompt], params_for(i))[0]), i
    # The greedy requests through model.generate in one left-padded batch (transformers' own cache).
    ids, mask = left_pad([prompts[0], prompts[2]])
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    assert [mixed[0].token_ids, mixed[2].token_ids] == generated[:, ids.shape[1]:].tolist()
    scored = score_sequences(model, [prompt + mixed[i].token_ids for i, prompt in enumerate(prompts)])
    for i in range(len(prompts)):
        assert torch.equal(torch.tensor(mixed[i].prompt_logprobs + mixed[i].logprobs, dtype=torch.float32),
                           scored[i].token_logprobs), i


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_negative_control_a_scan_chunk_chosen_by_the_step(hybrid_models, monkeypatch):
    """Chunks of 32 whenever a step holds more than one sequence: the mixed run's bits change. (At a
    budget of 200 the 66-token prompt is prefilled beside another; at 7 only one step holds a segment
    past 32 rows, and the tiny model's fast decay keeps its difference below a logprob's last bit.)"""
    model = hybrid_models("qwen3_5_text")
    scan = linear_attention.chunk_gated_delta_rule

    def batch_chunk(*args, **kwargs):
        return scan(*args, **kwargs, chunk=32 if args[7].shape[0] > 1 else gated_delta_rule.CHUNK)
    monkeypatch.setattr(linear_attention, "chunk_gated_delta_rule", batch_chunk)
    mixed = mixed_run(model, 200)
    monkeypatch.undo()
    alone = Engine(model).generate(prompts_for(model.config.vocab_size), [params_for(i) for i in range(3)])
    assert not all(same(mixed[i], alone[i]) for i in range(3))


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_negative_control_a_step_that_forgets_the_unfinished_chunk(hybrid_models, monkeypatch):
    """Each step's scan starting at its own first token (the unfinished chunk's rows dropped, the
    boundary state kept): chunked prefill and decode no longer equal one forward."""
    model = hybrid_models("qwen3_5_text")
    step = linear_state_slots.LinearAttentionSlots.step

    def forgetful(self, slot_ids, computed, query_lens, fresh, device):
        layout = step(self, slot_ids, computed, query_lens, fresh, device)
        layout.scan["start"] = layout.scan["out_from"]
        return layout
    monkeypatch.setattr(linear_state_slots.LinearAttentionSlots, "step", forgetful)
    prompts = prompts_for(model.config.vocab_size)
    outputs = Engine(model, max_num_batched_tokens=7).generate(prompts, [params_for(i) for i in range(3)])
    scored = score_sequences(model, [prompt + outputs[i].token_ids for i, prompt in enumerate(prompts)])
    assert not all(torch.equal(torch.tensor(outputs[i].prompt_logprobs + outputs[i].logprobs), scored[i].token_logprobs)
                   for i in range(3))


def prefix_run(model, budget: int):
    """A request, then four that share its first 150 tokens or its first 70: each of the three
    longer ones hits at 128 (a budget of 2048 saves the state where the first prefill chunk is cut,
    at 128; a budget of 7 saves it at 64 too, for the fourth)."""
    shared = prompts_for(model.config.vocab_size, (150,), seed=3)[0]
    prompts = [shared + [5, 6, 7], shared + [9], shared[:70], shared + [1, 2, 3, 4, 5] * 10]
    params = [params_for(i) for i in range(len(prompts))]
    for p in params:
        p.prompt_logprobs = None  # a request that asks for prompt logprobs computes its whole prompt
    engine = Engine(model, max_num_batched_tokens=budget)
    engine.generate(prompts[:1], params[:1])
    return engine, engine.generate(prompts, params), Engine(model, enable_prefix_caching=False).generate(prompts,
                                                                                                      params)


@pytest.mark.fast_cells(ids=["qwen3_5_text-2048"])
# The saved states are the Gated DeltaNet layers' own, the same in every hybrid family (the engine's
# schedule test runs Qwen3-Next's): the dense family suffices (CI time). The fast tier takes the one-step
# prefill; the 7-token budget (prefill chunks across the saved states) runs in the heavy tier.
@pytest.mark.parametrize("family, budget", [("qwen3_5_text", 7), ("qwen3_5_text", 2048)], ids=lambda v: str(v))
def test_a_prefix_hit_restores_the_state_a_miss_computes(hybrid_models, family, budget):
    engine, cached, uncached = prefix_run(hybrid_models(family), budget)
    assert engine.core.blocks.prefix_states.restored >= 3 and engine.core.blocks.prefix_hits >= 3 * 128
    for a, b in zip(cached, uncached):
        assert same(a, b)


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_negative_control_a_hit_without_its_state(hybrid_models, monkeypatch):
    """Pages hit but the slot's state not restored (left as the slot's last owner had it): other bits."""
    monkeypatch.setattr(linear_state_slots.LinearAttentionSlots, "restore", lambda self, index, slot: None)
    engine, cached, uncached = prefix_run(hybrid_models("qwen3_5_text"), 2048)
    assert engine.core.blocks.prefix_states.restored >= 3
    assert not all(same(a, b) for a, b in zip(cached, uncached))


def test_what_the_engine_does_not_run_yet_is_refused_by_name(hybrid_models):
    model = hybrid_models("qwen3_5_text")
    for options, reason in ((dict(speculative={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
                            (dict(max_loras=1), "LoRA")):
        with pytest.raises(UnsupportedModelError, match=f"Gated DeltaNet.*{reason}"):
            Engine(model, **options)
