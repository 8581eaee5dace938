"""Pooling over a row's real tokens (mean, weighted mean, mean / sqrt(n)) and row-wise L2 normalisation:
a row alone == the same row in any batch, at any padding amount and side; a block size picked by the
batch size (negative control) fails that check; within tolerance of float64, and the tolerance sees a
wrong weighting or divisor."""
import pytest
import torch
import torch.nn.functional as F

from helpers.models import DEVICES
from invariant_infer.kernels import l2_normalize, pool_tokens
from invariant_infer.kernels import pooling as pooling_kernel
from invariant_infer.kernels.errors import UnsupportedOperationError

HIDDEN = 48  # not a power of two: the last column block is masked
LENGTHS = [1, 5, 16, 17, 40, 33, 9]  # one block, a block and one, several blocks
MODES = {"mean": (False, "count"), "weightedmean": (True, "weight_sum"), "mean_sqrt_len_tokens": (False, "sqrt_count")}
# |pooled - float64| <= TOLERANCE * the row's mean |x| (fp32: the sum's rounding; bf16: the output's)
TOLERANCE = {torch.float32: 2 ** -20, torch.bfloat16: 2 ** -7}


def _rows(dtype):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, HIDDEN, generator=g) * 3 + 0.25).to(dtype) for n in LENGTHS]


def _padded(rows, order, side, extra):
    """[B, L, H] of ``rows[order]`` padded on ``side`` with garbage, and the (start, end) bounds."""
    width = max(rows[i].shape[0] for i in order) + extra
    device = rows[0].device
    x = torch.full((len(order), width, HIDDEN), 7.0, dtype=rows[0].dtype, device=device)
    start, end = (torch.zeros(len(order), dtype=torch.int64, device=device) for _ in range(2))
    for slot, i in enumerate(order):
        n = rows[i].shape[0]
        first = width - n if side == "left" else 0
        x[slot, first:first + n] = rows[i]
        start[slot], end[slot] = first, first + n
    return x, start, end


# (order, padding side, padding beyond the longest row): batch sizes 2, 3, all; both sides; shuffled
BATCHINGS = [((0, 4), "left", 0), ((4, 1, 2), "right", 3), ((6, 5, 4, 3, 2, 1, 0), "left", 5),
             ((3, 0, 6, 2, 5, 1, 4), "right", 0)]


def _mismatched_rows(pool_fn, rows, weighted, divisor):
    """How many rows of the batchings differ from the row pooled alone (unpadded, batch of one)."""
    bounds = [torch.tensor([0, row.shape[0]], device=row.device) for row in rows]
    alone = [pool_fn(row[None], bound[:1], bound[1:], weighted, divisor)[0] for row, bound in zip(rows, bounds)]
    mismatched = 0
    for order, side, extra in BATCHINGS:
        x, start, end = _padded(rows, order, side, extra)
        out = pool_fn(x, start, end, weighted, divisor)
        mismatched += sum(not torch.equal(out[slot], alone[i]) for slot, i in enumerate(order))
    return mismatched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_a_row_alone_equals_it_in_any_batch_and_padding(mode, dtype, device):
    rows = [row.to(device) for row in _rows(dtype)]
    assert _mismatched_rows(pool_tokens, rows, *MODES[mode]) == 0


def test_negative_control_a_block_size_picked_by_the_batch_size_fails(monkeypatch):
    """The same kernel with BLOCK_T 4 for a lone row and 32 in a batch: the check above catches it."""
    def block_by_batch(x, start, end, weighted, divisor):
        with monkeypatch.context() as patch:
            patch.setattr(pooling_kernel, "BLOCK_T", 4 if x.shape[0] == 1 else 32)
            return pool_tokens(x, start, end, weighted, divisor)
    assert _mismatched_rows(block_by_batch, _rows(torch.float32), *MODES["mean"]) > 0


def _reference(row, mode):
    x, n = row.double(), row.shape[0]
    if mode == "weightedmean":
        weights = torch.arange(1, n + 1, dtype=torch.float64)[:, None]
        return (x * weights).sum(0) / weights.sum()
    return x.sum(0) / (n ** 0.5 if mode == "mean_sqrt_len_tokens" else n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_within_tolerance_of_float64_and_the_tolerance_sees_a_wrong_pooling(dtype):
    rows = _rows(dtype)
    x, start, end = _padded(rows, range(len(rows)), "left", 2)
    wrong = {"mean": "weightedmean", "weightedmean": "mean", "mean_sqrt_len_tokens": "mean"}
    for mode, (weighted, divisor) in MODES.items():
        out = pool_tokens(x, start, end, weighted, divisor)
        for slot, row in enumerate(rows):
            scale = row.double().abs().mean().item()
            assert (out[slot].double() - _reference(row, mode)).abs().max().item() <= TOLERANCE[dtype] * scale
            if row.shape[0] > 1:
                off = (out[slot].double() - _reference(row, wrong[mode])).abs().max().item()
                assert off > 10 * TOLERANCE[dtype] * scale


def test_a_row_without_tokens_pools_to_zeros_and_autograd_is_refused():
    x = torch.randn(2, 4, HIDDEN)
    out = pool_tokens(x, torch.tensor([0, 2]), torch.tensor([3, 2]))
    assert torch.equal(out[1], torch.zeros(HIDDEN))
    with pytest.raises(UnsupportedOperationError, match="pool_tokens has no backward"):
        pool_tokens(x.requires_grad_(), torch.tensor([0, 0]), torch.tensor([4, 4]))


# ---- L2 normalisation ------------------------------------------------------------------------------------

def _chunked_by_rows_normalize(x, eps=1e-12):
    """Negative control: the sum of squares in chunks whose size depends on the number of rows."""
    rows = x.reshape(-1, x.shape[-1]).float()
    chunk = 4 if rows.shape[0] == 1 else 16
    norm = (rows * rows).reshape(rows.shape[0], -1, chunk).sum(-1).sum(-1).sqrt()
    return (rows / norm.clamp_min(eps)[:, None]).to(x.dtype).reshape(x.shape)


def _normalize_mismatches(normalize_fn, x):
    batched = normalize_fn(x)
    return sum(not torch.equal(normalize_fn(x[i:i + 1])[0], batched[i]) for i in range(x.shape[0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_rows_alone_equal_the_batch_and_match_float64(dtype, device):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 1024, generator=g) * 2).to(dtype).to(device)
    assert _normalize_mismatches(l2_normalize, x) == 0
    assert _normalize_mismatches(_chunked_by_rows_normalize, x.float()) > 0  # the check can fail
    want = F.normalize(x.double(), dim=-1)  # on x's device
    tolerance = {torch.float32: 2 ** -21, torch.bfloat16: 2 ** -7}[dtype]  # |y| <= 1
    out = l2_normalize(x)
    assert (out.double() - want).abs().max().item() <= tolerance
    assert (out.double() - F.normalize(x.double(), dim=-1, p=1)).abs().max().item() > 10 * tolerance
    assert torch.equal(l2_normalize(torch.zeros(2, 8, device=device)), torch.zeros(2, 8, device=device))  # eps
