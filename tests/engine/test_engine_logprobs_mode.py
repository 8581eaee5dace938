"""``SamplingParams.logprobs_mode``: "processed_logprobs" reports every logprob (sampled tokens, top
alternatives, prompt tokens) of log_softmax(logits / temperature), bitwise the ``token_logprobs``
kernel at that temperature on the ``model(...)`` logits of the sequence alone, whatever batch the
request ran in; "raw_logprobs" (the default) reports the model's own distribution as before."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.models import load_model
from invariant_infer import make_invariant
from invariant_infer.engine import Engine, RequestError, SamplingParams
from invariant_infer.kernels import linear, token_logprobs

pytestmark = pytest.mark.file_minutes(0.6)  # measured on 2 cores: start it early

T = 0.7


@pytest.fixture(scope="module")
def models(family_checkpoints):
    cache = {}

    def get(dtype):
        if dtype not in cache:
            cache[dtype] = make_invariant(load_model(family_checkpoints("qwen2"), dtype))
        return cache[dtype]
    return get


def prompts_for(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def params(i: int, mode: str) -> SamplingParams:
    """Seeded sampling at T (greedy for every third request), prompt logprobs and top alternatives."""
    return SamplingParams(max_tokens=4, temperature=0.0 if i % 3 == 2 else T, seed=40 + i, logprobs=2,
                          prompt_logprobs=1, ignore_eos=True, logprobs_mode=mode)


def continuous_batching(model, prompts, modes) -> list:
    """Request i joins at step i (a small token budget chunks the prefills among the others' decodes)."""
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=6)
    outputs, ids, step = {}, {}, 0
    while len(outputs) < len(prompts):
        if step < len(prompts):
            ids[engine.add_request(prompts[step], params(step, modes[step]))] = step
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
        step += 1
        assert step < 200, "the engine stopped making progress"
    return [outputs[i] for i in range(len(prompts))]


def alone_logprobs(model, out, temperature: float):
    """(prompt logprobs, generated-token logprobs, one top-alternatives dict) of the full sequence run
    alone through ``model(...)``, by the kernel at ``temperature``."""
    prompt, generated = out.prompt_token_ids, out.token_ids
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    values = token_logprobs(logits[:-1], ids[0, 1:], temperature)[0]
    row = logits[len(prompt) - 1]
    top = torch.topk(row.float(), 2).indices
    top_values = token_logprobs(row[None].expand(2, -1), top, temperature)[0]
    return (values[:len(prompt) - 1], values[len(prompt) - 1:],
            dict(zip(top.tolist(), top_values.tolist())))


def mismatches(model, outputs) -> list[int]:
    """The requests whose reported logprobs differ from the sequence alone at their mode's temperature."""
    bad = []
    for i, out in enumerate(outputs):
        temperature = params(i, "processed_logprobs").logprob_temperature if i % 2 == 0 else 1.0
        prompt_lp, gen_lp, top = alone_logprobs(model, out, temperature)
        if not (torch.equal(torch.tensor(out.prompt_logprobs), prompt_lp)
                and torch.equal(torch.tensor(out.logprobs), gen_lp) and out.top_logprobs[0] == top):
            bad.append(i)
    return bad


MODES = ["processed_logprobs", "raw_logprobs"] * 3  # processed for even requests, raw for odd ones


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_processed_and_raw_logprobs_equal_the_sequence_alone(models, dtype):
    model = models(dtype)
    prompts = prompts_for(model.config.vocab_size, (9, 3, 14, 5, 11, 7), seed=1)
    outputs = continuous_batching(model, prompts, MODES)
    assert mismatches(model, outputs) == []
    # The mode changes what is reported, never the tokens; greedy (T = 0) is reported at T = 1.
    swapped = continuous_batching(model, prompts, MODES[1:] + MODES[:1])
    for i, (a, b) in enumerate(zip(outputs, swapped)):
        assert a.token_ids == b.token_ids
        assert (a.logprobs == b.logprobs) == (i % 3 == 2), i
    processed = torch.tensor(outputs[0].logprobs)
    assert not torch.equal(processed, alone_logprobs(model, outputs[0], 1.0)[1])


def engine_step_keyed_linear(x, weight, bias=None, config=None):
    """BLOCK_K 16 up to 8 rows (every step of the engine below: its token budget is 6), the shape's own
    config (or the caller's tree) above, as row-count-keyed heuristics do."""
    if x.reshape(-1, x.shape[-1]).shape[0] <= 8:
        return m_dependent_linear(x, weight, bias)
    return linear(x, weight, bias, config=config)


@pytest.mark.heavy
def test_negative_control_m_dependent_linear_changes_processed_logprobs(models, monkeypatch):
    """The same comparison with projections that pick BLOCK_K by M: some request's logprobs differ
    from the sequence alone (fp32, where a reordered sum shows)."""
    model = models(torch.float32)
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", engine_step_keyed_linear)
    prompts = prompts_for(model.config.vocab_size, (9, 3, 14, 5, 11, 7), seed=1)
    assert mismatches(model, continuous_batching(model, prompts, MODES)) != []


@pytest.mark.parametrize("field, value", [("top_k", 5), ("top_p", 0.9), ("repetition_penalty", 1.2)])
def test_processed_logprobs_refuse_filters_they_would_not_reflect(models, field, value):
    engine = Engine(models(torch.bfloat16))
    request = SamplingParams(temperature=T, logprobs_mode="processed_logprobs", **{field: value})
    with pytest.raises(RequestError, match=f"logprobs_mode='processed_logprobs'.*{field}") as refused:
        engine.add_request([1, 2, 3], request)
    assert refused.value.param == field
    engine.add_request([1, 2, 3], SamplingParams(temperature=T, **{field: value}))  # raw: accepted
    with pytest.raises(RequestError, match="logprobs_mode must be one of") as refused:
        engine.add_request([1, 2, 3], SamplingParams(logprobs_mode="processed"))
    assert refused.value.param == "logprobs_mode"


def test_stock_kernels_report_the_scaled_distribution_too(family_checkpoints):
    """Without the invariant kernels, processed logprobs are torch's log_softmax(logits.float() / T)."""
    model = load_model(family_checkpoints("qwen2"), torch.float32)  # the engine sets its attention
    prompt = prompts_for(model.config.vocab_size, (6,), seed=2)[0]
    out = Engine(load_model(family_checkpoints("qwen2"), torch.float32), kernels="stock").generate(
        [prompt], SamplingParams(max_tokens=3, temperature=T, seed=3, ignore_eos=True,
                                 logprobs_mode="processed_logprobs"))[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float() / T, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
    assert (torch.tensor(out.logprobs) - ref).abs().max().item() < 1e-5
