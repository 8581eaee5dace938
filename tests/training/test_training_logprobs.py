"""``invariant_infer.training.logprobs.token_logprobs``: the trainer's logprobs, differentiable, bitwise equal to
``score_sequences``, ``engine.score`` and the engine's sampled-token logprobs (at the sampling
temperature with ``logprobs_mode="processed_logprobs"``), whatever the micro-batch split or padding."""
import pytest
import torch

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.engine_runs import trainer_logprobs
from helpers.models import FAMILY_NAMES, load_model
from invariant_infer import make_invariant, pad_sequences, score_sequences
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.training.logprobs import scored_positions, token_logprobs

T = 0.7


def rollouts(model, count=5, temperature=T):
    """Seeded samples from the engine under continuous batching: (prompt + completion ids, prompt length,
    the engine's logprobs of the completion)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 2, 9, 3, 7)[:count]]
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=8)
    params = [SamplingParams(max_tokens=4 + i, temperature=temperature, seed=i, ignore_eos=True,
                             logprobs_mode="processed_logprobs") for i in range(count)]
    outs = engine.generate(prompts, params)
    return [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids), o.logprobs) for o in outs]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("family, dtype", [(f, torch.bfloat16) for f in FAMILY_NAMES] + [("qwen2", torch.float32)])
def test_trainer_logprobs_equal_the_engines_at_any_micro_batch(family_checkpoints, family, dtype):
    model = make_invariant(load_model(family_checkpoints(family), dtype))
    samples = rollouts(model)
    sequences, prompt_lengths, engine_logps = zip(*samples)
    for micro_batch, side in [(1, "left"), (2, "right"), (5, "left")]:
        got = trainer_logprobs(model.train(), list(sequences), prompt_lengths, micro_batch, side, T)
        assert got == list(engine_logps), (family, dtype, micro_batch, side)


@pytest.mark.heavy
def test_negative_control_m_dependent_sampler_is_caught(tiny_checkpoint, monkeypatch):
    """A sampler whose projections pick their tiles by the step's row count (decode steps have few);
    fp32, where a reordered sum shows."""
    model = make_invariant(load_model(tiny_checkpoint, torch.float32))
    with monkeypatch.context() as patched:
        patched.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
        sequences, prompt_lengths, engine_logps = zip(*rollouts(model))
    got = trainer_logprobs(model.train(), list(sequences), prompt_lengths, 5, "left", T)
    assert got != list(engine_logps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_at_temperature_one_they_equal_score_sequences_and_engine_score(tiny_checkpoint, dtype):
    model = make_invariant(load_model(tiny_checkpoint, dtype))
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (6, 11, 2)]
    scored = [r.token_logprobs.tolist() for r in score_sequences(model, sequences)]
    engine = [r.token_logprobs.tolist() for r in Engine(model).score(sequences)]
    ids, mask = pad_sequences(sequences, side="right")
    logps = token_logprobs(model.train(), ids, mask)
    got = [logps[row, :len(seq) - 1].tolist() for row, seq in enumerate(sequences)]
    assert got == scored == engine


def test_gradients_flow_and_are_deterministic(tiny_checkpoint):
    model = make_invariant(load_model(tiny_checkpoint, torch.bfloat16)).train()
    ids, mask = pad_sequences([[3, 4, 5, 6, 7], [8, 9]], side="left")

    def grads():
        model.zero_grad(set_to_none=True)
        logps = token_logprobs(model, ids, mask, temperature=T)
        assert logps.requires_grad and logps.dtype == torch.float32
        logps.sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    first, second = grads(), grads()
    assert all(g.abs().sum() > 0 for g in first), "every parameter gets gradient"
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gradient_of_the_logprobs_matches_float64(tiny_checkpoint):
    """fp32 kernels against the stock model in float64 on the same weights: relative max error < 1e-4."""
    from invariant_infer import restore

    model = make_invariant(load_model(tiny_checkpoint, torch.float32)).train()
    ids, mask = pad_sequences([[3, 4, 5, 6, 7], [8, 9, 10]], side="right")
    token_logprobs(model, ids, mask, temperature=T).sum().backward()
    reference = restore(load_model(tiny_checkpoint, torch.float64)).train()
    logits = reference(input_ids=ids, attention_mask=mask).logits[:, :-1] / T
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (ref * scored_positions(ids, mask, None)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        err = ((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()).item()
        assert err < 1e-4, (name, err)


def test_unscored_positions_are_zero_padding_and_packed_starts():
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert scored_positions(ids, mask, None).tolist() == [[False, False, True, True], [True] * 4]
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert scored_positions(ids[1:], None, packed).tolist() == [[True, True, False, True]]


def test_bad_arguments_are_refused(tiny_checkpoint):
    model = load_model(tiny_checkpoint, torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="make_invariant"):
        token_logprobs(model, ids)
    make_invariant(model)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, temperature=0.0)


@pytest.mark.heavy
def test_packed_rows_give_the_engines_logprobs(tiny_checkpoint):
    """One packed row (position_ids restarting at each sequence, as DataCollatorWithFlattening builds it)."""
    model = make_invariant(load_model(tiny_checkpoint, torch.bfloat16))
    sequences, prompt_lengths, engine_logps = zip(*rollouts(model))
    ids = torch.tensor([sum(sequences, [])])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    logps = token_logprobs(model.train(), ids, position_ids=positions, temperature=T)[0]
    starts = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0).tolist()
    got = [logps[a + p - 1:b - 1].tolist() for a, b, p in zip(starts, starts[1:], prompt_lengths)]
    assert got == list(engine_logps)
    assert all(logps[b - 1] == 0 for b in starts[1:-1]), "the first token of the next sequence is not scored"
