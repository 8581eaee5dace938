"""Training Gemma 3's text model (sliding-window layers beside global ones, gelu_tanh MLP, (1 + w)
norms): the trainer's ``token_logprobs`` equal the engine's sampled-token logprobs at any micro-batch
and padding, prompts longer than the window; each parameter's gradient is close to stock's in
float64 (the window, the activation and the norms differentiate); TRL GRPO logs a sampler-trainer
logprob difference of exactly 0. Negative control: a trainer whose attention window is one key
longer than the engine's gives other logprobs."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.model.attention as attention_module
from helpers.engine_runs import grpo_run, trainer_logprobs
from helpers.models import load_model, make_samples
from helpers.tokenizer import save_tokenizer
from invariant_infer import make_invariant, pad_sequences, restore
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

FAMILY = "gemma3_text"
T = 0.7
GRAD_TOLERANCE = 1e-4  # fp32 invariant gradients against stock's in float64: relative Frobenius error


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("train-gemma3"), random_config(FAMILY, "tiny"), seed=0)
    save_tokenizer(path)
    return path


def rollouts(model):
    """Seeded samples from the engine (chunked prefill, continuous batching), prompts past the
    24-key window: (prompt + completion ids, prompt length, the engine's logprobs)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (66, 2, 9, 30)]
    params = [SamplingParams(max_tokens=4 + i, temperature=T, seed=i, ignore_eos=True,
                             logprobs_mode="processed_logprobs") for i in range(len(prompts))]
    outs = Engine(model, max_num_seqs=3, max_num_batched_tokens=16).generate(prompts, params)
    return [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids), o.logprobs) for o in outs]


@pytest.mark.fast_cells(ids=["torch.bfloat16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_trainer_logprobs_equal_the_engines_at_any_micro_batch(checkpoint, dtype):
    model = make_invariant(load_model(checkpoint, dtype))
    sequences, prompt_lengths, engine_logps = zip(*rollouts(model))
    for micro_batch, side in [(1, "left"), (3, "right"), (4, "left")]:
        with torch.enable_grad():
            got = trainer_logprobs(model.train(), list(sequences), prompt_lengths, micro_batch, side, T)
        assert got == list(engine_logps), (micro_batch, side)


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_negative_control_a_trainer_window_one_key_longer(checkpoint, monkeypatch):
    model = make_invariant(load_model(checkpoint, torch.float32))
    sequences, prompt_lengths, engine_logps = zip(*rollouts(model))
    attend = attention_module.attend

    def wider(query, key, value, kv_start, kv_end, q_start, scale, window=0, sinks=None):
        return attend(query, key, value, kv_start, kv_end, q_start, scale, window + 1 if window else 0, sinks)
    monkeypatch.setattr(attention_module, "attend", wider)
    with torch.enable_grad():
        got = trainer_logprobs(model.train(), list(sequences), prompt_lengths, 4, "left", T)
    assert got != list(engine_logps)


def parameter_grads(model, samples) -> dict[str, torch.Tensor]:
    ids, mask = pad_sequences(samples, side="left")
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    logps = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    (logps * (mask[:, :-1] * mask[:, 1:])).sum().backward()  # real positions predicting real tokens
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_every_parameter_gradient_is_stocks_in_float64(checkpoint):
    """One left-padded batch through the invariant model; the stock model in float64 takes each
    sample alone (its positions ignore left padding)."""
    samples = make_samples(512, lengths=(9, 70, 5))
    got = parameter_grads(make_invariant(load_model(checkpoint, torch.float32)).train(), samples)
    stock = restore(load_model(checkpoint, torch.float64)).train()
    want = {name: sum(grads) for name, *grads in
            zip(got, *(parameter_grads(stock, [s]).values() for s in samples))}
    for name, grad in got.items():
        error = ((grad.double() - want[name]).norm() / want[name].norm()).item()
        assert error < GRAD_TOLERANCE, (name, error)


@pytest.mark.heavy
def test_trl_grpo_logs_a_sampler_trainer_difference_of_zero(checkpoint, tmp_path):
    differences, changed = grpo_run(load_model(checkpoint, torch.float32), checkpoint, tmp_path, T)
    assert differences == [0.0, 0.0], differences
    assert changed
