"""Python scoring API: batching never changes a bit, values match a stock fp32 log_softmax."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.model.layer_forwards
import invariant_infer.model.logits
from helpers.controls import m_dependent_linear
from helpers.models import load_model
from invariant_infer import make_invariant
from invariant_infer.scoring.core import (ScoreResult, logprob_digest, naive_token_logprobs, plan_batches,
                                     score_sequences, token_logprobs_from_hidden)

# |invariant - stock fp32 HF + torch.log_softmax| per token logprob on the tiny random model;
# bf16 also carries rounded weights. Measured max over 20 sequences: bf16 2.5e-3, fp32 9.5e-7.
# (fp16, like every dtype, is checked for invariance and accuracy at model level.)
TOLERANCE_VS_STOCK_FP32 = {torch.bfloat16: 0.02, torch.float32: 1e-5}


def random_sequences(count: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 28, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def stock_fp32(tiny_checkpoint):
    return load_model(tiny_checkpoint, torch.float32)


def stock_logprobs(model, seq: list[int], prompt_length: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(seq[prompt_length:])
    return logprobs[prompt_length - 1:-1].gather(1, targets[:, None])[:, 0]


def test_plan_batches_respects_budget_and_keeps_every_index():
    lengths = [5, 30, 2, 30, 9, 17, 4]
    for budget in (1, 10, 40, 64, 1000):
        batches = plan_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for batch in batches:
            assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= budget
        flat = [lengths[i] for b in batches for i in b]
        assert flat == sorted(flat, reverse=True)
    assert plan_batches(lengths, 1) == [[1], [3], [5], [4], [0], [6], [2]]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bitwise_equal_for_any_batching_and_close_to_stock(tiny_checkpoint, stock_fp32, dtype):
    model = make_invariant(load_model(tiny_checkpoint, dtype))
    sequences = random_sequences(9)
    prompt_lengths = [1 + (i % 3) for i in range(len(sequences))]
    alone = score_sequences(model, sequences, prompt_lengths=prompt_lengths, max_batch_tokens=1)
    packed = score_sequences(model, sequences, prompt_lengths=prompt_lengths, max_batch_tokens=10_000)
    chunked = score_sequences(model, sequences, prompt_lengths=prompt_lengths, max_batch_tokens=60, chunk_rows=5)
    for a, b, c in zip(alone, packed, chunked):
        assert torch.equal(a.token_logprobs, b.token_logprobs) and torch.equal(a.token_logprobs, c.token_logprobs)
        assert a.digest == b.digest == c.digest and a.greedy == b.greedy == c.greedy
    for seq, start, result in zip(sequences, prompt_lengths, packed):
        assert result.num_tokens == len(seq) - start
        ref = stock_logprobs(stock_fp32, seq, start)
        assert (result.token_logprobs - ref).abs().max().item() <= TOLERANCE_VS_STOCK_FP32[dtype]


def test_negative_control_m_dependent_linear_is_caught(tiny_checkpoint, monkeypatch):
    """The batching comparison fails when the linear (layers and lm_head) picks BLOCK_K by M:
    3-token sequences alone run at M <= 4, packed at M > 4. (The tiny random model's logprobs sit
    near -log(512), where one fp32 step is 5e-7: a reordering shows in some sequences, not all.)"""
    model = make_invariant(load_model(tiny_checkpoint, torch.float32))
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    monkeypatch.setattr(invariant_infer.model.logits, "linear", m_dependent_linear)  # the lm_head
    sequences = [seq[:3] for seq in random_sequences(9)]
    alone = score_sequences(model, sequences, max_batch_tokens=1)
    packed = score_sequences(model, sequences, max_batch_tokens=10_000)
    assert not all(torch.equal(a.token_logprobs, b.token_logprobs) for a, b in zip(alone, packed))


def test_result_fields():
    result = ScoreResult(torch.tensor([-1.5, -0.25], dtype=torch.float32), greedy=True)
    assert result.num_tokens == 2 and result.logprob == -1.75
    assert result.digest == logprob_digest([-1.5, -0.25])
    import hashlib
    assert result.digest == hashlib.sha256(bytes.fromhex("0000c0bf" "000080be")).hexdigest()


def test_lean_logprobs_match_naive_and_ignore_chunking():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(20, 64, generator=g), torch.randn(700, 64, generator=g) * 0.2
    targets = torch.randint(0, 700, (20,), generator=g)
    lean, lean_hit = token_logprobs_from_hidden(hidden, weight, targets)
    naive, naive_hit = naive_token_logprobs(hidden, weight, targets)
    assert (lean - naive).abs().max().item() < 1e-5 and torch.equal(lean_hit, naive_hit)
    for chunk_rows in (1, 7, 64):
        again, _ = token_logprobs_from_hidden(hidden, weight, targets, chunk_rows=chunk_rows)
        assert torch.equal(again, lean)


def test_greedy_flag(tiny_checkpoint):
    model = make_invariant(load_model(tiny_checkpoint, torch.float32))
    seq = [7, 100]
    with torch.no_grad():  # continue greedily for three tokens, then once more with a non-argmax token
        for _ in range(3):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    greedy, not_greedy = score_sequences(model, [seq, seq[:-1] + [(seq[-1] + 1) % 512]], prompt_lengths=[2, 2])
    assert greedy.greedy and not not_greedy.greedy


def test_refuses_stock_model_and_bad_sequences(tiny_checkpoint):
    model = load_model(tiny_checkpoint, torch.float32)
    with pytest.raises(ValueError, match="make_invariant"):
        score_sequences(model, [[1, 2, 3]])
    make_invariant(model)
    for bad, match in (([1], "nothing to score"), ([1, 512], "outside the vocabulary"), ([], "empty"),
                       ([1] * 513, "longer than")):
        with pytest.raises(ValueError, match=match):
            score_sequences(model, [[1, 2], bad])
    with pytest.raises(ValueError, match="empty prompt"):
        score_sequences(model, [[1, 2]], prompt_lengths=[0])

