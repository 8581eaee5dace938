"""Training hybrid models (Qwen3.5's text model: Gated DeltaNet beside gated attention): the forward is
the invariant kernels' (a train-mode forward with grad gives inference's bits, the trainer's
``token_logprobs`` equal the engine's sampled-token logprobs at any micro-batch and padding), the
backward recomputes the Gated DeltaNet layers, the zero-centred RMSNorms and the output gate in
fp32 torch (the recomputation is the forward's derivative: finite differences in float64), and each
parameter's gradient is close to stock's in float64; TRL GRPO logs a sampler-trainer logprob
difference of exactly 0. Negative control: a scan chunk chosen by the
micro-batch gives the trainer other logprobs than the engine's. A backward through a forward that
continues a cached sequence is refused by name."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.model.linear_attention as linear_attention
from helpers.engine_runs import grpo_run, trainer_logprobs
from helpers.models import load_model, make_samples
from helpers.tokenizer import save_tokenizer
from invariant_infer import UnsupportedModelError, make_invariant, pad_sequences, restore
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.kernels import gated_delta_rule
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

FAMILY = "qwen3_5_text"
T = 0.7
# fp32 invariant gradients against stock's in float64: relative Frobenius error per parameter. Stock's
# torch fallback of the gated delta rule computes in fp32 even in a float64 model, and its gradients
# of the decay (A_log, dt_bias, in_proj_a) are 0.5% from finite differences (ours: 1e-9).
GRAD_TOLERANCE, DECAY_GRAD_TOLERANCE = 1e-3, 1e-2
DECAY = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("train-qwen3_5"), random_config(FAMILY, "tiny"), seed=0)
    save_tokenizer(path)
    return path


def rollouts(model):
    """Seeded samples from the engine (chunked prefill, continuous batching), prompts across the
    scan's chunk boundary: (prompt + completion ids, prompt length, the engine's logprobs)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (66, 2, 9, 30)]
    params = [SamplingParams(max_tokens=4 + i, temperature=T, seed=i, ignore_eos=True,
                             logprobs_mode="processed_logprobs") for i in range(len(prompts))]
    outs = Engine(model, max_num_seqs=3, max_num_batched_tokens=16).generate(prompts, params)
    return [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids), o.logprobs) for o in outs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.heavy)], ids=str)
def test_trainer_logprobs_equal_the_engines_at_any_micro_batch(checkpoint, dtype):
    model = make_invariant(load_model(checkpoint, dtype))
    sequences, prompt_lengths, engine_logps = zip(*rollouts(model))
    for micro_batch, side in [(1, "left"), (3, "right"), (4, "left")]:
        with torch.enable_grad():
            got = trainer_logprobs(model.train(), list(sequences), prompt_lengths, micro_batch, side, T)
        assert got == list(engine_logps), (micro_batch, side)


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_negative_control_a_scan_chunk_chosen_by_the_micro_batch(checkpoint, monkeypatch):
    """fp32 (bf16 hidden states round much of a reordering away in a model this small), with slow
    decays (the random init's forget within a token or two, and the state then carries too little
    across a chunk boundary to move a logprob)."""
    model = make_invariant(load_model(checkpoint, torch.float32))
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.A_log.data.fill_(-3.0)
    sequences, prompt_lengths, engine_logps = zip(*rollouts(model))
    scan = linear_attention.chunk_gated_delta_rule

    def batch_chunk(*args, **kwargs):
        return scan(*args, **kwargs, chunk=32 if args[7].shape[0] > 1 else gated_delta_rule.CHUNK)
    monkeypatch.setattr(linear_attention, "chunk_gated_delta_rule", batch_chunk)
    assert trainer_logprobs(model.train(), list(sequences), prompt_lengths, 4, "left", T) != list(engine_logps)


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
        assert error < (DECAY_GRAD_TOLERANCE if name.endswith(DECAY) else GRAD_TOLERANCE), (name, error)


def test_the_recomputed_backward_is_the_derivative_of_the_forward(checkpoint):
    """The Gated DeltaNet recomputation in float64 (a 70-token sequence across the chunk boundary):
    its autograd derivative along a random direction of every input equals the central finite
    difference of the same function, within 1e-6 relative."""
    layer = load_model(checkpoint, torch.float64).model.layers[0].linear_attn
    hidden = torch.randn(1, 70, layer.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    inputs = [*(x.detach() for x in linear_attention._projections(layer, hidden)), *(p.detach() for p in (
        layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight))]
    reference = linear_attention._reference_core(layer, [(0, 70)], (1, 70, layer.num_v_heads, layer.head_v_dim))
    directions = [torch.randn_like(x) for x in inputs]
    with torch.enable_grad():
        leaves = [x.clone().requires_grad_() for x in inputs]
        grads = torch.autograd.grad(reference(*leaves).sum(), leaves)
    derivative = sum((g * d).sum() for g, d in zip(grads, directions)).item()
    step = 1e-6
    with torch.no_grad():
        ahead = reference(*(x + step * d for x, d in zip(inputs, directions))).sum()
        behind = reference(*(x - step * d for x, d in zip(inputs, directions))).sum()
    assert abs(derivative - (ahead - behind).item() / (2 * step)) <= 1e-6 * abs(derivative)


def test_a_backward_through_a_continued_cache_is_refused(checkpoint):
    model = make_invariant(load_model(checkpoint, torch.float32)).train()
    cache = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True).past_key_values
    out = model(input_ids=torch.tensor([[8]]), past_key_values=cache, use_cache=True).logits
    with pytest.raises(UnsupportedModelError, match="continues a cached sequence"):
        out.sum().backward()


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_trl_grpo_logs_a_sampler_trainer_difference_of_zero(checkpoint, tmp_path):
    differences, changed = grpo_run(load_model(checkpoint, torch.float32), checkpoint, tmp_path, T)
    assert differences == [0.0, 0.0], differences
    assert changed
