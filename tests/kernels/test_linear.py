"""Invariant linear: accuracy against float64, and bitwise row invariance over M."""
import pytest
import torch

from helpers.controls import m_dependent_linear
from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import LinearConfig, linear, linear_config
from invariant_infer.kernels.configs import row_parallel_config

# Max relative error (|y - ref|.max / |ref|.max) against float64: bf16 / fp16 outputs are rounded
# to 8 / 11 bits; fp32 accumulates in fp32 (IEEE, no TF32).
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 2e-6}
BATCH_SIZES = [1, 2, 3, 7, 16, 17, 33, 64, 100]


def _weights(n, k, dtype, device, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_accuracy(dtype, device, bias):
    w, b = _weights(300, 200, dtype, device, bias)
    x = torch.randn(37, 200).to(dtype).to(device)
    y = linear(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (37, 300)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_alone_equals_row_in_any_batch(dtype, device):
    w, b = _weights(96, 160, dtype, device)
    pool = torch.randn(max(BATCH_SIZES), 160).to(dtype).to(device)
    alone = torch.stack([linear(pool[i:i + 1], w, b)[0] for i in range(8)])
    for m in BATCH_SIZES:
        for pos in sorted({0, m // 2, m - 1}):
            # Put sample i at row `pos` of a batch of m rows drawn from elsewhere in the pool.
            i = (m + pos) % 8
            batch = pool[torch.randperm(pool.shape[0])[:m]].clone()
            batch[pos] = pool[i]
            assert torch.equal(linear(batch, w, b)[pos], alone[i]), f"M={m} pos={pos}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_k_chunks_same_bits_on_both_schedules(dtype, device):
    """K cut into chunks fixed per weight shape: the sequential and the parallel (split-K)
    schedules give the same bits, so picking the schedule by M keeps the result M-invariant."""
    cfg = LinearConfig(16, 64, 32, k_chunks=3)
    w, b = _weights(80, 200, dtype, device)
    x = torch.randn(50, 200).to(dtype).to(device)
    sequential = linear(x, w, b, config=cfg, parallel_chunks=False)
    parallel = linear(x, w, b, config=cfg, parallel_chunks=True)
    assert torch.equal(sequential, parallel)
    ref = x.double() @ w.double().T + b.double()
    assert ((parallel.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[dtype]
    for i in (0, 17, 49):  # small M on the parallel schedule, the batch on the sequential one
        assert torch.equal(linear(x[i:i + 1], w, b, config=cfg, parallel_chunks=True)[0], sequential[i])


def test_negative_control_m_dependent_config_breaks_invariance():
    # fp32 outputs show a reordering in almost every element. A single bf16 product hides most of
    # them behind its 8-bit rounding (about 1 element in 10^4 flips); through a model's layers
    # they compound, which the model-level negative controls show.
    dtype = torch.float32
    w, b = _weights(96, 512, dtype, "cpu")
    x = torch.randn(8, 512).to(dtype)
    batched = m_dependent_linear(x, w, b)
    mismatched = [i for i in range(8) if not torch.equal(m_dependent_linear(x[i:i + 1], w, b)[0], batched[i])]
    assert mismatched, "an M-dependent BLOCK_K should change some row's bits"
    # ...while the fixed config, on the same data, is bitwise invariant.
    fixed = linear(x, w, b)
    assert all(torch.equal(linear(x[i:i + 1], w, b)[0], fixed[i]) for i in range(8))


def test_linear_config_never_depends_on_m():
    import inspect
    assert "m" not in inspect.signature(linear_config).parameters


def test_linear_rejects_mixed_dtypes():
    w, b = _weights(8, 16, torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="share a dtype"):
        linear(torch.randn(2, 16), w, b)
    with pytest.raises(TypeError, match="supports"):
        linear(torch.randn(2, 16, dtype=torch.float64), w.double())


def test_n_slice_of_the_weights_keeps_every_bit():
    """A row's output column depends on its weight row and the K reduction order (K and the config)
    only, not on N: the outputs of a slice of the weight rows are bitwise those columns of the full
    product. The real-width tests below rely on this to run two N tiles of the real weights."""
    n, k = 256, 1536  # Qwen2.5-1.5B's k/v projection, in full
    cfg = linear_config("cuda", torch.bfloat16, n, k)
    w, b = _weights(n, k, torch.bfloat16, "cpu")
    x = torch.randn(5, k).bfloat16()
    full = linear(x, w, b, config=cfg, parallel_chunks=True)
    for tiles in (slice(0, 2), slice(3, 5)):
        rows = slice(tiles.start * cfg.block_n, tiles.stop * cfg.block_n)
        assert torch.equal(linear(x, w[rows], b[rows], config=cfg, parallel_chunks=True), full[:, rows])


@pytest.mark.parametrize("shape, row", [((1536, 1536), False), ((256, 1536), False), ((8960, 1536), False),
                                        ((1536, 8960), True), ((1536, 1536), True)])
def test_gpu_rule_configs_are_invariant_in_the_interpreter(shape, row):
    """The GPU rule's configs (``linear_config`` / ``row_parallel_config`` on CUDA), run through the
    interpreter on two N tiles of weights of the real shape (the real K, so the real reduction
    order): both schedules give the same bits, rows equal alone and in a batch, and accuracy holds."""
    n, k = shape
    cfg = (row_parallel_config if row else linear_config)("cuda", torch.bfloat16, n, k)
    w, b = _weights(n, k, torch.bfloat16, "cpu")
    w, b = w[:2 * cfg.block_n], b[:2 * cfg.block_n]
    x = torch.randn(5, k).bfloat16()
    batch = linear(x, w, b, config=cfg, parallel_chunks=False)
    assert torch.equal(linear(x, w, b, config=cfg, parallel_chunks=True), batch)
    assert torch.equal(linear(x[3:4], w, b, config=cfg, parallel_chunks=True)[0], batch[3])
    ref = x.double() @ w.double().T + b.double()
    assert ((batch.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[torch.bfloat16]
