"""Autograd through the invariant linear: gradients against float64, the same micro-batch gives the
same bits twice, and a row's input gradient is bitwise the same alone and in any batch.

No gradcheck: the kernels support bf16 / fp16 / fp32 only, not float64."""
import pytest
import torch

from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import LinearConfig, linear, linear_config, linear_autograd

# Max relative error (|g - ref|.max / |ref|.max) against float64 autograd on the same rounded
# inputs: each gradient is one product accumulated in fp32 (IEEE, no TF32) and rounded once to
# the dtype, so the forward's bounds hold: 8 / 11 bits for bf16 / fp16.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 2e-6}
BATCH_SIZES = [1, 2, 3, 7, 16, 17, 33]


def _operands(shape, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(*shape, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    dy = torch.randn(*shape[:-1], n, generator=g).to(dtype).to(device)
    return x, w, b, dy


def _grads(x, w, b, dy, **kwargs):
    """(y, dX, dW, db) through linear_autograd; None for an operand that needs no gradient."""
    leaves = [t.detach().requires_grad_(grad) if t is not None else None
              for t, grad in zip((x, w, b), kwargs.pop("needs", (True, True, True)))]
    y = linear_autograd(*leaves, **kwargs)
    y.backward(dy)
    return (y.detach(), *(None if t is None else t.grad for t in leaves))


def _rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 72), (3, 5, 72)])
def test_gradients_match_float64(dtype, device, shape):
    x, w, b, dy = _operands(shape, 40, dtype, device)
    y, dx, dw, db = _grads(x, w, b, dy)
    assert torch.equal(y, linear(x, w, b)), "the forward is the inference kernel, bit for bit"
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    torch.nn.functional.linear(*ref).backward(dy.double())
    for name, got, want in zip("xwb", (dx, dw, db), (t.grad for t in ref)):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert _rel_err(got, want) < TOLERANCE[dtype], f"d{name}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_micro_batch_gives_the_same_bits_twice(dtype, device):
    x, w, b, dy = _operands((2, 9, 72), 40, dtype, device)
    first, second = _grads(x, w, b, dy), _grads(x, w, b, dy)
    assert all(torch.equal(a, c) for a, c in zip(first, second))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layout_of_the_operands_never_changes_the_bits(dtype):
    """Transposed and sliced views go to the kernel through their strides: same bits as contiguous."""
    x, w, b, dy = _operands((24, 72), 40, dtype, "cpu")
    contiguous = _grads(x, w, b, dy)
    strided = _grads(x.t().contiguous().t(), w.t().contiguous().t(), b, dy.t().contiguous().t())
    assert all(torch.equal(a, c) for a, c in zip(contiguous, strided))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_gradient_of_a_row_alone_equals_it_in_any_batch(dtype, device):
    x, w, b, dy = _operands((max(BATCH_SIZES), 72), 160, dtype, device)
    input_only = dict(needs=(True, False, False))
    alone = torch.stack([_grads(x[i:i + 1], w, b, dy[i:i + 1], **input_only)[1][0] for i in range(8)])
    for m in BATCH_SIZES:
        for pos in sorted({0, m // 2, m - 1}):
            i = (m + pos) % 8  # sample i at row `pos` of a batch of m rows drawn from elsewhere
            rows = torch.randperm(x.shape[0])[:m]
            xb, dyb = x[rows].clone(), dy[rows].clone()
            xb[pos], dyb[pos] = x[i], dy[i]
            assert torch.equal(_grads(xb, w, b, dyb, **input_only)[1][pos], alone[i]), f"M={m} pos={pos}"


def test_negative_control_m_dependent_grad_input_config_breaks_invariance():
    """The same check fails when dX's reduction over N uses a BLOCK_K picked by M."""
    x, w, b, dy = _operands((8, 96), 512, torch.float32, "cpu")
    base = linear_config("cpu", torch.float32, 96, 512)  # dX's kernel: weight W^T [K, N]

    def m_dependent(m):
        return LinearConfig(base.block_m, base.block_n, 16 if m <= 4 else 64)

    input_only = dict(needs=(True, False, False))
    batched = _grads(x, w, b, dy, grad_input_config=m_dependent(8), **input_only)[1]
    mismatched = [i for i in range(8) if not torch.equal(
        _grads(x[i:i + 1], w, b, dy[i:i + 1], grad_input_config=m_dependent(1), **input_only)[1][0], batched[i])]
    assert mismatched, "an M-dependent BLOCK_K should change some row's input gradient"
    fixed = _grads(x, w, b, dy, **input_only)[1]
    assert all(torch.equal(_grads(x[i:i + 1], w, b, dy[i:i + 1], **input_only)[1][0], fixed[i]) for i in range(8))


def test_parameters_accumulate_gradients_as_usual():
    """Gradient accumulation over two micro-batches into an nn.Parameter: the sum of each one's grads."""
    x, w, b, dy = _operands((10, 72), 40, torch.float32, "cpu")
    weight, bias = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    for rows in (slice(0, 6), slice(6, 10)):
        linear_autograd(x[rows], weight, bias).backward(dy[rows])
    parts = [_grads(x[rows], w, b, dy[rows], needs=(False, True, True)) for rows in (slice(0, 6), slice(6, 10))]
    assert torch.equal(weight.grad, parts[0][2] + parts[1][2])
    assert torch.equal(bias.grad, parts[0][3] + parts[1][3])


def test_empty_batch_and_no_bias():
    x, w, _, dy = _operands((0, 72), 40, torch.float32, "cpu")
    _, dx, dw, _ = _grads(x, w, None, dy, needs=(True, True, False))
    assert dx.shape == (0, 72) and torch.equal(dw, torch.zeros_like(w))



def test_grad_output_in_another_dtype_arrives_in_the_forward_dtype():
    """Autograd casts the incoming gradient to y's dtype before the backward runs."""
    x, w, b, dy = _operands((4, 72), 40, torch.bfloat16, "cpu")
    cast = _grads(x, w, b, dy.float())
    assert all(torch.equal(a, c) for a, c in zip(cast, _grads(x, w, b, dy)))
