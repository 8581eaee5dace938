"""Host syncs of an engine step (counted on CPU by ``invariant_infer.testing.host_syncs``): none inside the
decoder's forward, and outside it (sampling, logprobs, top and prompt logprobs) a fixed number, the same at
1, 8 and 32 running sequences, in a decode step and in a step that mixes a prefill with decodes. Dense,
MoE and hybrid (Gated DeltaNet) models; the control: a layer that reads a value back is counted and named."""
from __future__ import annotations

import pytest
import torch

from invariant_infer import make_invariant
from invariant_infer.engine import SamplingParams
from invariant_infer.engine.core import EngineCore
from invariant_infer.model.checks import base_model
from invariant_infer.testing.host_syncs import count_host_syncs
from invariant_infer.testing.random_checkpoints import random_config, random_model

def params(i: int) -> SamplingParams:
    """Greedy and seeded rows, each with its top logprobs and prompt logprobs (one logprob temperature)."""
    seeded = dict(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i) if i % 2 else {}
    return SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1, **seeded)


def step_syncs(model, running: int) -> dict[str, tuple[int, int]]:
    """{step kind: (syncs inside the decoder's forward, syncs in the whole step)} with ``running`` requests."""
    core = EngineCore(model, max_num_seqs=64, max_num_batched_tokens=1024)
    vocab = core.vocab_size
    g = torch.Generator().manual_seed(running)
    def prompt() -> list[int]:
        return torch.randint(1, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
    for i in range(running):
        core.add_token_request(prompt(), params(i))
    core.step_deltas()  # the prefills
    counts = {}
    for kind in ("decode", "mixed"):
        if kind == "mixed":  # a new request's prefill beside the running ones' decodes
            core.add_token_request(prompt(), params(running))
        with count_host_syncs() as whole, count_host_syncs(inside=base_model(model)) as inside:
            deltas = core.step_deltas()
        assert len(deltas) == running + (kind == "mixed") and not any(d.error for d in deltas)
        assert inside.count == 0, inside.summary()
        counts[kind] = (inside.count, whole.count)
    return counts


@pytest.fixture(scope="module")
def models():
    """One decoder layer: a step's syncs do not depend on the depth, and the interpreter's time does."""
    cache = {}

    def get(family):
        if family not in cache:
            # (the hybrid's tiny preset has one Gated DeltaNet layer and one gated attention layer)
            config = random_config(family, "tiny", **({} if family == "qwen3_5_text" else {"num_hidden_layers": 1}))
            cache[family] = make_invariant(random_model(config, dtype=torch.bfloat16).eval())
        return cache[family]
    return get


# The fast tier compares 1 and 8 running on the dense model; the heavy tier 1, 8 and 32 on each kind.
@pytest.mark.parametrize("family, running", [
    ("qwen2", (1, 8)), *(pytest.param(family, (1, 8, 32), marks=pytest.mark.heavy)
                         for family in ("qwen2", "qwen3_moe", "qwen3_5_text"))], ids=lambda v: str(v))
def test_a_step_syncs_a_fixed_number_of_times_and_never_inside_the_forward(models, family, running):
    counts = {n: step_syncs(models(family), n) for n in running}
    assert all(counts[n] == counts[1] for n in running), counts
    assert counts[1]["decode"][1] > 0  # the sampled tokens and logprobs do reach the host, and are counted


def test_control_a_layer_that_reads_a_value_back_is_counted_and_named(models):
    model = models("qwen2")
    core = EngineCore(model, max_num_seqs=8)
    core.add_token_request([1, 2, 3], params(0))
    handle = base_model(model).layers[0].register_forward_hook(lambda module, args, out: out[0].sum().item())
    try:
        with count_host_syncs(inside=base_model(model)) as inside:
            core.step_deltas()
    finally:
        handle.remove()
    assert inside.count == 1 and inside.events[0].call == "item"
    assert "tests/engine/test_engine_host_syncs.py" in inside.events[0].where[0]
