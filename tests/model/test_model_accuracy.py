"""Accuracy, checked apart from invariance, for every family: invariant logits against a float64
reference and against stock fp32.

Per dtype, the invariant model's relative error (Frobenius norm over all real-token logits)
must be no more than twice stock HF's own error in the same dtype."""
import pytest
import torch

from helpers.models import DTYPES, load_model
from helpers.models import Batching, logits_batched, make_samples
from invariant_infer import make_invariant

BATCHING = Batching((0, 1, 2, 3), extra_pad=2)


def _relative_error(got, ref):
    got = torch.cat([g.double() for g in got])
    ref = torch.cat([r.double() for r in ref])
    return ((got - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def logits():
    """(checkpoint, dtype, "stock" or "invariant") -> the batch's real-token logits, each computed
    once per module (the interpreter runs the invariant ones; both tests below use them)."""
    cache = {}

    def get(path, dtype, kind="stock"):
        key = (str(path), dtype, kind)
        if key not in cache:
            model = load_model(path, dtype)
            if kind == "invariant":
                make_invariant(model)
            cache[key] = logits_batched(model, make_samples(512), BATCHING)
        return cache[key]
    return get


@pytest.mark.fast_cells(4)
@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_error_at_most_twice_stock_error(family_checkpoint, dtype, logits):
    reference = logits(family_checkpoint, torch.float64)
    stock_error = _relative_error(logits(family_checkpoint, dtype), reference)
    invariant_error = _relative_error(logits(family_checkpoint, dtype, "invariant"), reference)
    assert 0 < invariant_error <= 2 * stock_error, (invariant_error, stock_error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_error_against_stock_fp32(family_checkpoint, dtype, logits):
    """The same bound with stock fp32 HF as the reference, the one users compare against (for fp32
    itself only a float64 reference can measure stock's own error)."""
    reference = logits(family_checkpoint, torch.float32)
    invariant_error = _relative_error(logits(family_checkpoint, dtype, "invariant"), reference)
    assert invariant_error <= 2 * _relative_error(logits(family_checkpoint, dtype), reference)
