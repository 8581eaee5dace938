"""Autograd through the token-logprob head: the forward's bits, d logits against float64 at several
temperatures, run-twice bits, and a row's gradient bitwise the same alone and in any batch.

No gradcheck: the kernels take bf16 / fp16 / fp32 logits only, not float64."""
import sys

import pytest
import torch

from helpers.kernel_compile import compile_for
from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import token_logprobs, token_logprobs_autograd
from invariant_infer.kernels.token_logprobs import vocab_block

autograd_mod = sys.modules["invariant_infer.kernels.token_logprobs_autograd"]
logprobs_mod = sys.modules["invariant_infer.kernels.token_logprobs"]

# Max |error| / max |float64 gradient| on the same rounded logits: fp32 arithmetic (measured
# <= 2.3e-7), then one rounding to the logits' dtype (8 / 11 bits for bf16 / fp16).
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}
TEMPERATURES = [1.0, 0.7, 1.5]


def inputs(rows, vocab, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(device)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(device)
    grad = torch.randn(rows, generator=g).to(device)
    return logits, targets, grad


def kernel_grad(logits, targets, grad, temperature=1.0, **kwargs):
    leaf = logits.detach().requires_grad_()
    (dlogits,) = torch.autograd.grad(token_logprobs_autograd(leaf, targets, temperature, **kwargs), (leaf,), grad)
    return dlogits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_forward_is_the_kernel_and_gradient_matches_float64(dtype, device, temperature):
    logits, targets, grad = inputs(37, 10_000, dtype, device)  # two CPU vocab blocks, 3 CPU programs
    leaf = logits.detach().requires_grad_()
    logprobs = token_logprobs_autograd(leaf, targets, temperature)
    assert torch.equal(logprobs, token_logprobs(logits, targets, temperature)[0])
    (dlogits,) = torch.autograd.grad(logprobs, (leaf,), grad)
    ref = logits.double().requires_grad_()
    torch.log_softmax(ref / temperature, -1).gather(1, targets[:, None])[:, 0].backward(grad.double())
    assert dlogits.dtype == dtype and dlogits.shape == logits.shape
    assert ((dlogits.double() - ref.grad).abs().max() / ref.grad.abs().max()).item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_same_rows_give_the_same_gradient_bits(dtype):
    logits, targets, grad = inputs(40, 3000, dtype, "cpu")
    assert torch.equal(kernel_grad(logits, targets, grad, 0.7), kernel_grad(logits, targets, grad, 0.7))


def row_mismatches(grads, logits, targets, grad) -> list:
    """The row subsets (each row alone, slices, a permutation) whose gradients differ from theirs in
    the full batch."""
    full, rows = grads(logits, targets, grad), logits.shape[0]
    subsets = [*(slice(r, r + 1) for r in range(rows)), slice(30, 40), slice(5, 22), torch.randperm(rows)]
    return [rows for rows in subsets if not torch.equal(grads(logits[rows], targets[rows], grad[rows]), full[rows])]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_of_a_row_does_not_depend_on_the_other_rows(dtype):
    assert row_mismatches(lambda *a: kernel_grad(*a, 0.7), *inputs(40, 9000, dtype, "cpu")) == []


@pytest.mark.heavy
def test_negative_control_rows_keyed_vocab_block_is_caught():
    """A vocabulary block width picked by the row count (the forward's reduction, whose lse the
    backward uses) gives a row alone other gradient bits than in the batch."""
    def rows_keyed(logits, targets, grad):
        return kernel_grad(logits, targets, grad, 0.7, block_v=64 if logits.shape[0] == 1 else None)

    logits, targets, grad = inputs(40, 9000, torch.float32, "cpu")
    assert vocab_block("cpu", 9000) != 64
    assert row_mismatches(rows_keyed, logits, targets, grad) != []


def test_rows_with_zero_gradient_get_zero_logit_gradients():
    logits, targets, grad = inputs(20, 3000, torch.bfloat16, "cpu")
    grad[::3] = 0.0
    dlogits = kernel_grad(logits, targets, grad, 0.7)
    assert torch.equal(dlogits[::3], torch.zeros_like(dlogits[::3]))
    assert (dlogits[1::3] != 0).any(dim=1).all()


def test_strided_logits_and_gradient_accumulation():
    """A sliced view goes through the kernel's contiguous copy: the same bits as contiguous rows; the
    gradient arrives in the view's shape, and accumulates into a leaf as usual."""
    logits, targets, grad = inputs(12, 3000, torch.float32, "cpu")
    wide = torch.cat([logits, logits], dim=1)
    view = wide.detach().requires_grad_()
    token_logprobs_autograd(view[:, :3000], targets).backward(grad)
    assert torch.equal(view.grad[:, :3000], kernel_grad(logits, targets, grad))
    assert torch.equal(view.grad[:, 3000:], torch.zeros_like(logits))
    leaf = logits.detach().requires_grad_()
    for rows in (slice(0, 5), slice(5, 12)):
        token_logprobs_autograd(leaf[rows], targets[rows]).backward(grad[rows])
    assert torch.equal(leaf.grad, kernel_grad(logits, targets, grad))


def test_bad_temperature_and_empty_rows():
    logits, targets, _ = inputs(2, 8, torch.float32, "cpu")
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs_autograd(logits.requires_grad_(), targets, bad)
    empty = torch.zeros(0, 8, requires_grad=True)
    token_logprobs_autograd(empty, torch.zeros(0, dtype=torch.long)).sum().backward()
    assert empty.grad.shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_real_vocab_gradient_and_row_invariance(dtype):
    vocab = 151936
    logits, targets, grad = inputs(33, vocab, dtype, "cuda")
    dlogits = kernel_grad(logits, targets, grad, 0.7)
    ref = logits.double().requires_grad_()
    torch.log_softmax(ref / 0.7, -1).gather(1, targets[:, None])[:, 0].backward(grad.double())
    assert ((dlogits.double() - ref.grad).abs().max() / ref.grad.abs().max()).item() < TOLERANCE[dtype]
    assert torch.equal(kernel_grad(logits, targets, grad, 0.7), dlogits)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 20), torch.randperm(33, device="cuda")):
        assert torch.equal(kernel_grad(logits[rows], targets[rows], grad[rows], 0.7), dlogits[rows])


@pytest.mark.parametrize("arch", [90, 89, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_compile_for_cuda(arch, dtype):
    """Offline (no GPU needed): the forward storing its lse and the backward, with the CUDA launch's
    blocks and pinned options, at Qwen's vocabulary."""
    element = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    block_v = vocab_block("cuda", 151936)
    warps = 4 if block_v <= 1024 else 8
    fp32 = {"ptr": element, "targets_ptr": "*i64", "temperature": "fp32"}
    assert compile_for(logprobs_mod._token_logprobs_kernel, arch,
                       {**fp32, "logprob_ptr": "*fp32", "argmax_ptr": "*i32", "lse_ptr": "*fp32"},
                       dict(BLOCK_ROWS=1, BLOCK_V=block_v, STORE_LSE=True), warps)
    assert compile_for(autograd_mod._token_logprobs_backward_kernel, arch,
                       {**fp32, "lse_ptr": "*fp32", "grad_ptr": "*fp32"},
                       dict(BLOCK_ROWS=1, BLOCK_V=block_v), warps)
