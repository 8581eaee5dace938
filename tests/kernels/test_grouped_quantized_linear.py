"""Grouped GEMM on quantized expert weights: bitwise a per-expert loop of ``quantized_linear``, a
row's bits the same alone and in any grouping, accuracy against float64, and the per-tensor
activation-scale control (vLLM #57016's fused-MoE FP8 bug)."""
import pytest
import torch

from test_quantized_linear import K, N, quantized_weight
from invariant_infer.kernels import QuantizedLinearConfig, QuantizedWeight, grouped_quantized_linear, quantized_linear
from invariant_infer.kernels.quantize_activations import quantize_activations

EXPERTS = 4
SPLITS = {"uneven": [0, 5, 19, 2], "one-row-each": [1, 1, 1, 1], "all-to-one": [0, 0, 33, 0]}
# (weight format, activation dtype or None for weight-only, activation group)
FORMATS = [("fp8_block", torch.float8_e4m3fn, 128), ("fp8", torch.float8_e4m3fn, None), ("int8", torch.int8, None),
           ("int4_asym", None, None), ("packed8", None, None)]
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3}  # as test_quantized_linear's


def _stacked(fmt, dtype):
    """(the experts' weights stacked, as a checkpoint's [E, ...] tensors, and each one's float64 values)."""
    weights, dense = zip(*(quantized_weight(fmt, dtype, seed=e) for e in range(EXPERTS)))
    stack = lambda ts: None if ts[0] is None else torch.stack(ts)  # noqa: E731
    one = weights[0]
    return QuantizedWeight(one.format, stack([w.data for w in weights]), stack([w.scale for w in weights]), one.shape,
                           bits=one.bits, group_size=one.group_size, block=one.block,
                           zero_point=stack([w.zero_point for w in weights])), dense


def _offsets(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])


def _run(x, weight, offsets, target, group, config=None):
    if target is None:
        return grouped_quantized_linear(x, weight, offsets, config=config)
    q, scale = quantize_activations(x, target, group)
    return grouped_quantized_linear(q, weight, offsets, x_scale=scale, out_dtype=x.dtype, config=config)


def _loop(x, weight, offsets, target, group):
    """The reference: ``quantized_linear`` on each expert's rows alone."""
    out = torch.empty(x.shape[0], N, dtype=x.dtype)
    for e in range(EXPERTS):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi == lo:
            continue
        if target is None:
            out[lo:hi] = quantized_linear(x[lo:hi], weight.expert(e))
        else:
            q, scale = quantize_activations(x[lo:hi], target, group)
            out[lo:hi] = quantized_linear(q, weight.expert(e), x_scale=scale, out_dtype=x.dtype)
    return out


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("fmt,target,group", FORMATS)
def test_bitwise_equal_to_a_loop_of_quantized_linear(fmt, target, group, split):
    dtype = torch.bfloat16 if split != "one-row-each" else torch.float16
    weight, _ = _stacked(fmt, dtype)
    offsets = _offsets(SPLITS[split])
    x = torch.randn(int(offsets[-1]), K).to(dtype)
    assert torch.equal(_run(x, weight, offsets, target, group), _loop(x, weight, offsets, target, group))


@pytest.mark.parametrize("fmt,target,group", FORMATS[:3])
def test_row_alone_equals_row_in_any_grouping(fmt, target, group):
    weight, _ = _stacked(fmt, torch.bfloat16)
    x = torch.randn(40, K).bfloat16()
    alone = _run(x[7:8], weight, _offsets([0, 0, 1, 0]), target, group)[0]
    for counts in ([3, 10, 20, 7], [0, 0, 40, 0], [39, 0, 1, 0]):
        offsets = _offsets(counts)
        rows = x.clone()
        where = int(offsets[2])  # the row sits at the start of expert 2's rows
        rows[[7, where]] = rows[[where, 7]]
        assert torch.equal(_run(rows, weight, offsets, target, group)[where], alone), counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accuracy_against_float64(dtype):
    weight, dense = _stacked("fp8_block", dtype)
    offsets = _offsets([6, 0, 9, 4])
    x = torch.randn(19, K).to(dtype)
    q, scale = quantize_activations(x, torch.float8_e4m3fn, 128)
    x_dense = (q.double().unflatten(1, (scale.shape[1], -1)) * scale.double()[..., None]).flatten(1)
    y = grouped_quantized_linear(q, weight, offsets, x_scale=scale, out_dtype=dtype)
    for e in range(EXPERTS):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            ref = x_dense[lo:hi] @ dense[e].T
            assert ((y[lo:hi].double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[dtype]


def test_negative_control_per_tensor_activation_scale_over_routed_rows():
    """Stock fused-MoE FP8 takes one activation scale over every routed row: a row's bits then
    follow its neighbours; the per-token scales above do not."""
    weight, _ = _stacked("fp8", torch.bfloat16)
    x = torch.randn(12, K).bfloat16()
    x[5] *= 40

    def per_tensor(rows, offsets):
        scale = (rows.float().abs().amax() / 448).reshape(1, 1).expand(rows.shape[0], 1).contiguous()
        return grouped_quantized_linear((rows.float() / scale).to(torch.float8_e4m3fn), weight, offsets,
                                        x_scale=scale, out_dtype=torch.bfloat16)
    offsets = _offsets([4, 4, 4, 0])
    batched = per_tensor(x, offsets)
    alone = [per_tensor(x[i:i + 1], _offsets([1, 0, 0, 0]))[0] for i in range(4)]
    assert not all(torch.equal(a, batched[i]) for i, a in enumerate(alone))
    fixed = _run(x, weight, offsets, torch.float8_e4m3fn, None)
    assert all(torch.equal(_run(x[i:i + 1], weight, _offsets([1, 0, 0, 0]), torch.float8_e4m3fn, None)[0], fixed[i])
               for i in range(4))


def test_negative_control_m_dependent_block_k():
    weight, _ = _stacked("int4", torch.float16)
    x = torch.randn(8, K).half()
    pick = lambda rows: QuantizedLinearConfig(64, 64, 16 if rows <= 4 else 64)  # noqa: E731
    batched = grouped_quantized_linear(x, weight, _offsets([8, 0, 0, 0]), config=pick(8))
    alone = [grouped_quantized_linear(x[i:i + 1], weight, _offsets([1, 0, 0, 0]), config=pick(1))[0]
             for i in range(8)]
    assert not all(torch.equal(a, batched[i]) for i, a in enumerate(alone))


def test_rejects_bad_operands():
    weight, _ = _stacked("fp8", torch.bfloat16)
    x = torch.randn(3, K).bfloat16()
    with pytest.raises(ValueError, match="stack"):
        grouped_quantized_linear(x, weight.expert(0), _offsets([3, 0, 0, 0]))
    with pytest.raises(ValueError, match="rise from 0"):
        grouped_quantized_linear(x, weight, _offsets([1, 1, 0, 0]))
    with pytest.raises(ValueError, match="E \\+ 1"):
        grouped_quantized_linear(x, weight, _offsets([3, 0, 0]))
    with pytest.raises(TypeError, match="take"):
        grouped_quantized_linear(x, weight, _offsets([3, 0, 0, 0]), x_scale=torch.ones(3, 1))
