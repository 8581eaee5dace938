"""The multi-LoRA engine (``invariant_infer.engine.lora_slots``): rows of different adapters and base
rows share one batch, and each request's tokens and logprobs are bitwise those of the request alone
with its adapter, whatever its neighbours, slot, load order, ``max_loras`` (with eviction and reload)
or ``max_lora_rank``; equal to the ``PeftModel``'s scoring; prefix hits never cross adapters.
Negative control: a LoRA shrink whose K split depends on the rows per adapter is caught."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from invariant_infer import make_invariant, score_sequences
from invariant_infer.engine import Engine, RequestError, SamplingParams
from invariant_infer.engine.lora_slots import LoraAdapterError
from invariant_infer.kernels import LinearConfig, linear_config
from invariant_infer.model import lora as lora_module
from invariant_infer.testing.random_checkpoints import qwen2_config, random_model
from invariant_infer.training import token_logprobs

DTYPE = torch.float32  # fp32, so that a changed reduction order reaches the logprobs (the control)
# Three adapters of different ranks and targets (name -> config); "c" uses rsLoRA.
ADAPTERS = {
    "a": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    "b": LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"], init_lora_weights=False),
    "c": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "up_proj"],
                    init_lora_weights=False),
}
PARAMS = SamplingParams(max_tokens=6, prompt_logprobs=0, ignore_eos=True)


def mixed_params(i: int) -> SamplingParams:
    """Greedy and seeded sampling alternate; all report prompt logprobs."""
    if i % 2 == 0:
        return PARAMS
    return SamplingParams(max_tokens=6, temperature=0.8, seed=10 + i, prompt_logprobs=0, ignore_eos=True)


def base_model(dtype=DTYPE):
    return random_model(qwen2_config("tiny", num_hidden_layers=1), seed=0, dtype=dtype)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    """name -> a PEFT adapter folder (save_pretrained of random nonzero A and B)."""
    dirs = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        model = get_peft_model(base_model(), copy.deepcopy(config))
        dirs[name] = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(dirs[name])
    return dirs


def lora_engine(adapter_dirs, order=("a", "b", "c"), dtype=DTYPE, **options):
    options = {"max_loras": 4, "max_lora_rank": 8, **options}
    engine = Engine(base_model(dtype), max_num_seqs=8, **options)
    for name in order:
        engine.add_lora(name, adapter_dirs[name])
    return engine


def prompts(count, length=5, seed=0):
    """Prompts that repeat a few random tokens (so ngram speculation finds proposals)."""
    g = torch.Generator().manual_seed(seed)
    motifs = [torch.randint(1, 256, (2 + i % 2,), generator=g).tolist() for i in range(count)]
    return [(motif * length)[:length + i % 3] for i, motif in enumerate(motifs)]


def outcome(out):
    return out.token_ids, out.logprobs, out.prompt_logprobs


MIXED = ["a", "b", None, "c", "a"]  # two rows share adapter a


@pytest.fixture(scope="module")
def alone(adapter_dirs):
    """Each mixed request run alone, on an engine holding only its own adapter."""
    results = []
    for i, (prompt, name) in enumerate(zip(prompts(len(MIXED)), MIXED)):
        engine = lora_engine(adapter_dirs, order=[name] if name else [], max_loras=1, max_lora_rank=16)
        results.append(outcome(engine.generate([prompt], mixed_params(i), lora=name)[0]))
    return results


def test_mixed_adapters_and_base_rows_equal_each_request_alone(adapter_dirs, alone):
    engine = lora_engine(adapter_dirs)
    outs = engine.generate(prompts(len(MIXED)), [mixed_params(i) for i in range(len(MIXED))], lora=MIXED)
    assert [outcome(o) for o in outs] == alone
    # The adapters change the outputs; base rows are the base model's (an engine with no adapters).
    base = Engine(base_model()).generate([prompts(len(MIXED))[2]], mixed_params(2))[0]
    assert outcome(base) == alone[2]
    plain = Engine(base_model()).generate(prompts(len(MIXED)), [mixed_params(i) for i in range(len(MIXED))])
    assert all(outcome(p)[2] != a[2] for p, a, name in zip(plain, alone, MIXED) if name)


@pytest.mark.parametrize(("order", "max_loras", "max_lora_rank"), [(("c", "b", "a"), 1, 8), (("b", "a", "c"), 2, 32)],
                         ids=["one-slot-evicting", "two-slots-rank-32"])
@pytest.mark.heavy
def test_slots_load_order_and_rank_padding_change_no_bit(adapter_dirs, alone, order, max_loras, max_lora_rank):
    engine = lora_engine(adapter_dirs, order=order, max_loras=max_loras, max_lora_rank=max_lora_rank)
    ids = [engine.add_request(p, mixed_params(i), lora=name) for i, (p, name) in enumerate(zip(prompts(len(MIXED)),
                                                                                              MIXED))]
    done, resident = {}, set()
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = outcome(out)
        resident.add(tuple(a.name for a in engine.list_loras() if a.slot is not None))
        assert sum(a.slot is not None for a in engine.list_loras()) <= max_loras
    assert [done[i] for i in ids] == alone
    if max_loras == 1:  # each adapter took the one slot in turn, a twice (evicted, then reloaded)
        assert {("a",), ("b",), ("c",)} <= resident


@pytest.mark.heavy
def test_speculative_decoding_with_adapters_changes_no_bit(adapter_dirs, alone):
    """ngram proposals verified under each row's own adapter: still each request alone, unspeculated."""
    engine = lora_engine(adapter_dirs, speculative={"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_max": 2})
    outs = engine.generate(prompts(len(MIXED)), [mixed_params(i) for i in range(len(MIXED))], lora=MIXED)
    stats = engine.core.speculative.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert [outcome(o) for o in outs] == alone


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_engine_score_equals_peft_model_scoring_and_token_logprobs(adapter_dirs, dtype):
    """In bf16, PEFT keeps the adapters in fp32 (its autocast_adapter_dtype default), as the engine does."""
    engine = lora_engine(adapter_dirs, dtype=dtype)
    sequences = prompts(3, length=6, seed=1)
    for name in ("b", "c"):
        peft_model = make_invariant(PeftModel.from_pretrained(base_model(dtype), adapter_dirs[name]))
        up_proj = peft_model.get_base_model().model.layers[0].mlp.up_proj  # both adapters target it
        assert up_proj.lora_A["default"].weight.dtype == torch.float32
        want = score_sequences(peft_model, sequences)
        got = engine.score(sequences, lora=name)
        assert all(torch.equal(g.token_logprobs, w.token_logprobs) for g, w in zip(got, want))
        with torch.no_grad():
            logps = token_logprobs(peft_model, torch.tensor(sequences[:1]))
        assert torch.equal(logps[0], got[0].token_logprobs)


def test_negative_control_rows_dependent_shrink_split_is_caught(adapter_dirs, alone, monkeypatch):
    """vLLM's split_k = 64 if batch < 128 else 8, at these widths: the shrink's K cut into 4 chunks
    when fewer than 8 rows share the adapter. Two prompts on adapter a make 11+ rows in the mixed
    prefill, 5 alone: the same comparison must fail."""
    def rows_dependent(device_type, dtype, rows, rank, k):
        base = linear_config(device_type, dtype, rank, k)
        return LinearConfig(base.block_m, base.block_n, 16, k_chunks=4 if rows < 8 else 1)
    monkeypatch.setattr(lora_module, "shrink_config", rows_dependent)
    outs = lora_engine(adapter_dirs).generate(prompts(len(MIXED)), [mixed_params(i) for i in range(len(MIXED))],
                                              lora=MIXED)
    assert [outcome(o) for o in outs] != alone


def test_prefix_cache_hits_never_cross_adapters(adapter_dirs):
    engine = lora_engine(adapter_dirs, max_loras=2)
    page = engine.core.blocks.page_size
    prompt = prompts(1, length=page + 3, seed=2)[0]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = outcome(engine.generate([prompt], params, lora="a")[0])
    assert engine.core.blocks.prefix_hits == 0
    other = outcome(engine.generate([prompt], params, lora="b")[0])
    base = outcome(engine.generate([prompt], params)[0])
    assert engine.core.blocks.prefix_hits == 0  # the same tokens under another adapter (or none): no hit
    again = outcome(engine.generate([prompt], params, lora="a")[0])
    assert engine.core.blocks.prefix_hits == page and again == first
    assert other != first and base != first


def test_adapter_registry_refusals(adapter_dirs, tmp_path):
    engine = lora_engine(adapter_dirs, order=("a",), max_lora_rank=4)
    assert [a.name for a in engine.list_loras()] == ["a"] and len(engine.list_loras()[0].sha256) == 64
    with pytest.raises(LoraAdapterError, match="rank 8, over max_lora_rank 4"):
        engine.add_lora("b", adapter_dirs["b"])
    with pytest.raises(LoraAdapterError, match="already loaded"):
        engine.add_lora("a", adapter_dirs["a"])
    wide = get_peft_model(random_model(qwen2_config("tiny", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                    num_attention_heads=2, num_key_value_heads=1)),
                          LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(LoraAdapterError, match="this model needs A"):
        engine.add_lora("other-model", wide)
    head = get_peft_model(base_model(), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(LoraAdapterError, match="lm_head"):
        engine.add_lora("head", head)
    assert [a.name for a in engine.list_loras()] == ["a"]  # nothing changed
    with pytest.raises(RequestError, match="unknown LoRA adapter 'nope'"):
        engine.add_request([1, 2, 3], PARAMS, lora="nope")
    with pytest.raises(RequestError, match="unknown LoRA adapter"):
        engine.generate([[1, 2], [3, 4]], PARAMS, lora=["a", "nope"])
    assert not engine.has_unfinished()  # refused before any request was added
    engine.add_request([1, 2, 3], PARAMS, lora="a")
    with pytest.raises(LoraAdapterError, match="in use by 1 unfinished"):
        engine.remove_lora("a")
    while engine.has_unfinished():
        engine.step()
    engine.remove_lora("a")
    assert engine.list_loras() == []
    with pytest.raises(LoraAdapterError, match="no adapter named 'a'"):
        engine.remove_lora("a")
    with pytest.raises(LoraAdapterError, match="max_loras"):
        Engine(base_model()).add_lora("a", adapter_dirs["a"])
    with pytest.raises(ValueError, match="runs a base model"):
        Engine(PeftModel.from_pretrained(base_model(), adapter_dirs["a"]), max_loras=1)
