"""generate() on a wrapped model: batched == alone and decode == one forward pass, bitwise, for the
dynamic and the static cache; seeded sampling independent of the batch; clear errors otherwise.
Every invariance comparison is torch.equal."""
from __future__ import annotations

import copy

import pytest
import torch

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.models import load_model
from invariant_infer import NonInvariantInputError, left_pad, make_invariant, restore
from invariant_infer.model import attention as hf_attention
from invariant_infer.generation.generate import generate_invariant, seeded_sampling
from invariant_infer.kernels import AttentionConfig, attention_config
from invariant_infer.generation.sampling import filter_logits, uniform_noise

NEW_TOKENS = 4
CACHES = [None, "static"]
# (members in order, extra left padding): any members, any order, any extra padding.
BATCHINGS = [((0, 1, 2, 3), 0), ((3, 1, 0), 5), ((2, 0), 2)]


def make_prompts(vocab_size: int, lengths=(6, 11, 3, 8), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths]


def run_generate(model, prompts, extra_pad=0, cache=None, device="cpu", **kwargs):
    """Left-padded greedy generate; returns per row (new tokens [N], per-step logits [N, V])."""
    input_ids, attention_mask = left_pad(prompts, device=device)
    pad = input_ids.new_zeros(len(prompts), extra_pad)
    input_ids, attention_mask = torch.cat([pad, input_ids], 1), torch.cat([pad, attention_mask], 1)
    if cache:
        kwargs["cache_implementation"] = cache
    kwargs.setdefault("do_sample", False)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    logits = torch.stack(out.logits, dim=1)  # [B, N, V]
    tokens = out.sequences[:, input_ids.shape[1]:]
    return [(tokens[row], logits[row]) for row in range(len(prompts))]


def forward_logits(model, prompt, tokens):
    """Logits of one forward pass over prompt + generated tokens, at the positions that predicted them."""
    ids = torch.tensor([list(prompt) + tokens.tolist()], device=tokens.device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].float()


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return make_invariant(load_model(tiny_checkpoint, torch.bfloat16))


@pytest.fixture(scope="module")
def prompts(model):
    return make_prompts(model.config.vocab_size)


@pytest.fixture(scope="module", params=CACHES, ids=["dynamic", "static"])
def alone(request, model, prompts):
    """Each prompt generated on its own: the reference."""
    return request.param, [run_generate(model, [p], cache=request.param)[0] for p in prompts]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("batching", BATCHINGS, ids=str)
def test_batched_generate_equals_alone(model, prompts, alone, batching):
    cache, reference = alone
    members, extra_pad = batching
    rows = run_generate(model, [prompts[i] for i in members], extra_pad, cache)
    for (tokens, logits), i in zip(rows, members):
        assert torch.equal(tokens, reference[i][0]), f"prompt {i}: tokens differ"
        assert torch.equal(logits, reference[i][1]), f"prompt {i}: logits differ"


@pytest.mark.fast_cells(1)
def test_decode_equals_forward(model, prompts, alone):
    cache, reference = alone
    for i, prompt in enumerate(prompts):
        tokens, logits = reference[i]
        assert torch.equal(logits, forward_logits(model, prompt, tokens)), f"prompt {i} ({cache})"


def test_decode_with_other_kv_block_is_caught(model, monkeypatch):
    """Negative control: a decode whose KV block differs from prefill's changes the bits."""
    def other_block_attention(q, k, v, kv_start, kv_end, q_start, scale, config=None, window=0, sinks=None):
        if q.shape[2] == 1:
            base = attention_config(q.device.type, q.dtype, q.shape[-1])
            config = AttentionConfig(base.block_m, base.block_n // 4)
        return attention(q, k, v, kv_start, kv_end, q_start, scale, config=config, window=window, sinks=sinks)

    attention = hf_attention.attention
    monkeypatch.setattr(hf_attention, "attention", other_block_attention)
    prompt = make_prompts(model.config.vocab_size, lengths=(40,), seed=1)[0]  # spans several small blocks
    tokens, logits = run_generate(model, [prompt])[0]
    assert not torch.equal(logits, forward_logits(model, prompt, tokens))


def test_batched_generate_with_m_dependent_linear_is_caught(tiny_checkpoint, monkeypatch):
    """Negative control: the batched-vs-alone comparison fails when the linear picks BLOCK_K by M
    (a 3-token prompt's prefill has M <= 4 alone, M > 4 in a batch)."""
    model = make_invariant(load_model(tiny_checkpoint, torch.float32))
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    short, other = make_prompts(model.config.vocab_size, lengths=(3, 11))
    in_batch = run_generate(model, [other, short])[1][1]
    assert not torch.equal(in_batch, run_generate(model, [short])[0][1])


# ---- seeded sampling ---------------------------------------------------------------------------------

SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.9)


def sample(model, prompts, seeds, cache=None):
    return [tokens for tokens, _ in run_generate(model, prompts, cache=cache,
                                                 logits_processor=seeded_sampling(seeds, **SAMPLING))]


@pytest.mark.heavy
def test_seeded_sampling_is_batch_invariant(model, prompts):
    seeds = [11, 22, 33, 44]
    reference = sample(model, prompts, seeds)
    for members, cache in (((2, 0, 3, 1), None), ((1, 3), "static"), ((0,), None)):
        got = sample(model, [prompts[i] for i in members], [seeds[i] for i in members], cache)
        for tokens, i in zip(got, members):
            assert torch.equal(tokens, reference[i]), f"prompt {i} sampled differently in batch {members}"
    other = sample(model, prompts, [seed + 1000 for seed in seeds])
    assert not all(torch.equal(a, b) for a, b in zip(reference, other))


def test_seeded_sampling_without_filters_samples_from_softmax():
    """Gumbel-max with our noise draws tokens in proportion to softmax(logits)."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    counts = torch.zeros(4)
    for step in range(4000):
        counts[torch.argmax(logits.double() - torch.log(-torch.log(uniform_noise(7, step, 4, "cpu"))))] += 1
    assert torch.allclose(counts / counts.sum(), logits.softmax(-1), atol=0.03)


def test_filters_are_exact():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, -5.0, 0.5])
    kept = filter_logits(logits, top_k=3).isfinite()
    assert kept.tolist() == [True, False, True, True, False, False]
    # probabilities 0.51, 0.07, 0.19, 0.19, 0.00, 0.04: 0.6 needs 3.0 and the first of the tied 2.0s
    kept = filter_logits(logits, top_p=0.6).isfinite()
    assert kept.tolist() == [True, False, True, False, False, False]
    assert filter_logits(logits, top_p=0.01).isfinite().sum() == 1


def test_generate_invariant_helper(model, prompts):
    out = generate_invariant(model, prompts[:2], max_new_tokens=2, seeds=[1, 2], **SAMPLING)
    alone = generate_invariant(model, prompts[1:2], max_new_tokens=2, seeds=[2], **SAMPLING)
    assert torch.equal(out[1, -2:], alone[0, -2:])


def test_repetition_penalty_skips_left_padding(model, prompts):
    """Qwen2.5-Instruct's generation config sets repetition_penalty: padded rows must not penalise
    their pad token, so a row's tokens equal the prompt's alone."""
    batch = run_generate(model, prompts, extra_pad=3, repetition_penalty=1.3)
    for row in (2, 1):  # the most and the least padded row
        tokens, logits = run_generate(model, [prompts[row]], repetition_penalty=1.3)[0]
        assert torch.equal(batch[row][0], tokens) and torch.equal(batch[row][1], logits)


def test_row_repetition_penalty_matches_hf_on_unpadded_rows():
    from transformers import RepetitionPenaltyLogitsProcessor
    from invariant_infer.generation.generate import RowRepetitionPenalty
    ids = torch.randint(0, 50, (3, 7))
    scores = torch.randn(3, 50)
    assert torch.equal(RowRepetitionPenalty(1.3, [0, 0, 0])(ids, scores),
                       RepetitionPenaltyLogitsProcessor(1.3)(ids, scores))


@pytest.mark.heavy
def test_max_length_with_padding_equals_alone(model, prompts, alone):
    """max_length counts the padded width, shared by every row: each row gets max_length - width new
    tokens, bitwise those it gets alone (lm-eval's generate_until passes width + max_gen_toks)."""
    cache, reference = alone
    input_ids, attention_mask = left_pad(prompts)
    width = input_ids.shape[1]
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_length=width + NEW_TOKENS,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                         **({"cache_implementation": cache} if cache else {}))
    assert out.sequences.shape[1] == width + NEW_TOKENS
    logits = torch.stack(out.logits, dim=1)
    for row in range(len(prompts)):
        assert torch.equal(out.sequences[row, width:], reference[row][0]), f"prompt {row}: tokens ({cache})"
        assert torch.equal(logits[row], reference[row][1]), f"prompt {row}: logits ({cache})"


# ---- clear errors ------------------------------------------------------------------------------------

def test_right_padding_is_rejected_before_decoding(model, prompts, monkeypatch):
    calls = []
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: calls.append(1))
    ids, mask = left_pad(prompts[:2])
    with pytest.raises(NonInvariantInputError, match="left"):
        model.generate(input_ids=ids.flip(1), attention_mask=mask.flip(1), max_new_tokens=2, do_sample=False)
    assert not calls


@pytest.mark.parametrize("options, match", [
    (dict(do_sample=True), "seeded_sampling"),
    (dict(num_beams=2), "beam search"),
    (dict(use_mtp=True), "multi-token prediction"),
    (dict(min_length=20), "min_length"),
    (dict(cache_implementation="offloaded"), "cache_implementation"),
    (dict(do_sample=True, logits_processor=seeded_sampling([1, 2])), "do_sample=False"),
    (dict(logits_processor=seeded_sampling([1, 2, 3])), "3 seeds for 2"),
])
def test_non_invariant_options_are_rejected(model, prompts, options, match):
    ids, mask = left_pad(prompts[:2])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(NonInvariantInputError, match=match):
        model.generate(**{**kwargs, **options})


def test_sampling_generation_config_is_rejected(model, prompts):
    config = copy.deepcopy(model.generation_config)
    config.do_sample = True
    with pytest.raises(NonInvariantInputError, match="multinomial"):
        model.generate(torch.tensor([prompts[0]]), generation_config=config, max_new_tokens=2)


def test_restore_removes_generate_checks(tiny_checkpoint):
    model = make_invariant(load_model(tiny_checkpoint, torch.float32))
    assert "generate" in vars(model)
    restore(model)
    assert "generate" not in vars(model)


# ---- GPU: static cache, compiled decode with CUDA graphs -------------------------------------------

@pytest.mark.gpu
def test_static_cache_generate_on_cuda(tiny_checkpoint):
    model = make_invariant(load_model(tiny_checkpoint, torch.bfloat16, "cuda"))
    prompts = make_prompts(model.config.vocab_size, lengths=(6, 11, 3))  # few shapes: each one recompiles
    reference = [run_generate(model, [p], cache="static", device="cuda")[0] for p in prompts]
    for members, extra_pad in (((0, 1, 2), 0), ((2, 0), 3)):
        rows = run_generate(model, [prompts[i] for i in members], extra_pad, "static", device="cuda")
        for (tokens, logits), i in zip(rows, members):
            assert torch.equal(tokens, reference[i][0]) and torch.equal(logits, reference[i][1]), (members, i)
    for prompt, (tokens, logits) in zip(prompts, reference):
        assert torch.equal(logits, forward_logits(model, prompt, tokens))
