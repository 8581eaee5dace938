"""The token_logprobs kernel: accuracy against float64 log_softmax, first-index argmax, and
row invariance (a row alone has the same bits as in any batch)."""
from __future__ import annotations

from importlib import import_module

import pytest
import torch

from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import token_logprobs
from invariant_infer.kernels.token_logprobs import vocab_block

# The module (the package's ``token_logprobs`` attribute is the function).
token_logprobs_module = import_module("invariant_infer.kernels.token_logprobs")

# |kernel - float64 log_softmax of the exact fp32 logits|: dominated by rounding the logits to the dtype
# (scale-3 logits; measured max 0.026 bf16, 0.003 fp16, 1e-6 fp32).
TOLERANCE_VS_FP32_LOGITS = {torch.bfloat16: 0.05, torch.float16: 0.01, torch.float32: 1e-5}
# |kernel - float64 log_softmax of the same (rounded) logits|: the reduction alone, any dtype.
TOLERANCE_VS_SAME_LOGITS = 1e-5  # measured <= 1.1e-6


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float32) * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [7, 512, 10_000])  # 10k spans two CPU blocks and five GPU blocks
def test_matches_float64_log_softmax(device, dtype, vocab):
    exact = random_logits(37, vocab).to(device)
    logits = exact.to(dtype)
    targets = torch.randint(0, vocab, (37,), generator=torch.Generator().manual_seed(1)).to(device)
    logprobs, is_argmax = token_logprobs(logits, targets)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (37,)
    gather = lambda x: torch.log_softmax(x.double(), -1).gather(1, targets[:, None])[:, 0]  # noqa: E731
    assert (logprobs.double() - gather(logits)).abs().max().item() <= TOLERANCE_VS_SAME_LOGITS
    assert (logprobs.double() - gather(exact)).abs().max().item() <= TOLERANCE_VS_FP32_LOGITS[dtype]
    assert torch.equal(is_argmax, logits.float().argmax(-1) == targets)


@pytest.mark.parametrize("device", DEVICES)
def test_large_offsets_are_stable(device):
    logits = (random_logits(5, 3000) + 1e4).to(device)
    targets = torch.arange(5, device=device)
    logprobs, _ = token_logprobs(logits, targets)
    ref = torch.log_softmax(logits.double(), -1)[torch.arange(5), targets]
    assert torch.isfinite(logprobs).all()
    assert (logprobs.double() - ref).abs().max().item() < 1e-2  # 1e4 in fp32 has ~1e-3 spacing


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_ties_break_to_first_index(device):
    vocab = 10_000
    far = vocab - 5  # in a later block than index 3 on every device
    assert far // vocab_block(torch.device(device).type, vocab) > 0
    logits = torch.zeros(2, vocab, device=device)
    logits[:, 3] = logits[:, far] = 5.0
    _, first = token_logprobs(logits, torch.tensor([3, 3], device=device))
    _, later = token_logprobs(logits, torch.tensor([far, far], device=device))
    assert first.all() and not later.any()
    assert torch.argmax(logits[0]).item() == 3  # same convention as torch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_alone_equals_row_in_batch(device, dtype):
    vocab = 9000
    logits = random_logits(40, vocab, seed=2).to(dtype).to(device)
    targets = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(3)).to(device)
    batch_lp, batch_hit = token_logprobs(logits, targets)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(4)).to(device)
    perm_lp, _ = token_logprobs(logits[perm], targets[perm])
    assert torch.equal(perm_lp, batch_lp[perm])
    for r in (0, 17, 39):
        alone_lp, alone_hit = token_logprobs(logits[r:r + 1], targets[r:r + 1])
        assert torch.equal(alone_lp, batch_lp[r:r + 1]) and torch.equal(alone_hit, batch_hit[r:r + 1])
        window_lp, _ = token_logprobs(logits[r // 2:r + 1], targets[r // 2:r + 1])  # other neighbours, offsets
        assert torch.equal(window_lp[-1], batch_lp[r])


def test_negative_control_other_vocab_block_differs(monkeypatch):
    """The comparison can fail: a row alone reduced over vocabulary blocks of another width (as a
    block picked by the row count would be) has other bits than in the batch."""
    vocab = 9000
    logits = random_logits(40, vocab, seed=2)
    targets = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(3))
    batch_lp, _ = token_logprobs(logits, targets)
    monkeypatch.setattr(token_logprobs_module, "vocab_block", lambda device_type, vocab_size: 1024)
    alone = [token_logprobs(logits[r:r + 1], targets[r:r + 1])[0] for r in (0, 17, 39)]
    assert not all(torch.equal(a, batch_lp[r:r + 1]) for a, r in zip(alone, (0, 17, 39)))


def test_rejects_bad_arguments():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="targets must lie"):
        token_logprobs(logits, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="expected logits"):
        token_logprobs(logits, torch.tensor([0]))
    with pytest.raises(TypeError):
        token_logprobs(logits.double(), torch.tensor([0, 1]))
    empty_lp, empty_hit = token_logprobs(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert empty_lp.shape == (0,) and empty_hit.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [0.7, 1.5, 0.05])
def test_temperature_scales_the_fp32_logits_as_the_sampler_does(device, dtype, temperature):
    """log_softmax(logits.float() / T), as ``sampling.seeded_scores`` scales; the argmax is the
    scaled row's."""
    logits = random_logits(37, 10_000).to(dtype).to(device)
    targets = torch.randint(0, 10_000, (37,), generator=torch.Generator().manual_seed(1)).to(device)
    logprobs, is_argmax = token_logprobs(logits, targets, temperature)
    scaled = logits.float() / temperature
    ref = torch.log_softmax(scaled.double(), -1).gather(1, targets[:, None])[:, 0]
    assert (logprobs.double() - ref).abs().max().item() <= TOLERANCE_VS_SAME_LOGITS * max(1.0, 1 / temperature)
    assert torch.equal(is_argmax, scaled.argmax(-1) == targets)
    assert not torch.equal(logprobs, token_logprobs(logits, targets)[0])


def test_rejects_temperatures_that_are_not_positive_numbers():
    logits, targets = torch.zeros(2, 8), torch.tensor([0, 1])
    for bad in (0, 0.0, -0.5, float("nan"), float("inf"), None, "1.0", True):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            token_logprobs(logits, targets, bad)
