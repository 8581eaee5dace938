"""Quantized linear: accuracy against float64 of the dequantized operands, and bitwise row invariance."""
from dataclasses import replace

import pytest
import torch

from invariant_infer.kernels.linear import combine_partials
from invariant_infer.kernels.quantize_activations import quantize_activations
from invariant_infer.kernels.quantized_linear import (QuantizedLinearConfig, QuantizedWeight, dequantize_weight,
                                                      quantized_linear, quantized_linear_config,
                                                      quantized_linear_partials, quantized_tree_leaves)

N, K = 160, 256
BATCH_SIZES = [1, 2, 5, 16, 33, 70]
# Max relative error against float64 of the same (dequantized) operands. Weight-only: the output is
# rounded to bf16 / fp16 (8 / 11 bits). Quantized activations: products are exact, so only the fp32
# sums and the output rounding remain.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def quantized_weight(fmt, scale_dtype, seed=0):
    """(QuantizedWeight, its dense dequantized values in float64 by the format's definition)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / 16
    if fmt in ("fp8", "int8"):
        qmax = 448.0 if fmt == "fp8" else 127.5
        scale = (w.abs().amax(1, keepdim=True) / qmax).to(scale_dtype)
        scaled = w / scale.float()
        q = scaled.clamp(-448, 448).to(torch.float8_e4m3fn) if fmt == "fp8" else scaled.round().clamp(-128, 127).to(torch.int8)
        return QuantizedWeight(fmt, q, scale, (N, K)), q.double() * scale.double()
    if fmt == "fp8_block":
        pad = torch.zeros(256, K)  # N = 160 is not a multiple of 128
        pad[:N] = w
        blocks = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).to(scale_dtype)
        full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N]
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        return QuantizedWeight("fp8", q, scale, (N, K), block=True), q.double() * full.double()
    bits, group = (4, 64) if fmt.startswith("int4") else (8, 128)
    qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    wg = w.unflatten(1, (-1, group))
    if fmt == "int4_asym":  # zero points per group: the range [min, max] maps onto [qmin, qmax]
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / (qmax - qmin)).to(scale_dtype)
        zero = (qmin - lo / scale.float()).round().clamp(qmin, qmax).to(torch.int8)
    else:
        scale, zero = (wg.abs().amax(-1) / ((2 ** bits - 1) / 2)).to(scale_dtype), torch.zeros(N, K // group)
    q = (wg / scale.float()[..., None] + zero[..., None]).round().clamp(qmin, qmax).flatten(1).to(torch.int8)
    dense = ((q.double().unflatten(1, (-1, group)) - zero.double()[..., None]) * scale.double()[..., None]).flatten(1)
    packed_zero = pack_to_int32(zero, bits, packed_dim=0) if fmt == "int4_asym" else None
    return QuantizedWeight("packed", pack_to_int32(q, bits), scale, (N, K), bits=bits, group_size=group,
                           zero_point=packed_zero), dense


WEIGHT_ONLY = ["int4", "int4_asym", "packed8", "int8", "fp8"]
W8A8 = [("fp8", torch.float8_e4m3fn, None), ("int8", torch.int8, None), ("fp8_block", torch.float8_e4m3fn, 128)]


def _run_w8a8(x, weight, target, group, bias=None):
    q, scale = quantize_activations(x, target, group)
    return quantized_linear(q, weight, bias, x_scale=scale, out_dtype=x.dtype)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", WEIGHT_ONLY)
def test_weight_only_accuracy_and_dequantization(act, fmt):
    weight, dense = quantized_weight(fmt, act)
    # The in-loop dequantization: (q * scale) rounded once to the scale dtype, exactly.
    assert torch.equal(dequantize_weight(weight), dense.to(act))
    x = torch.randn(37, K).to(act)
    b = torch.randn(N).to(act)
    y = quantized_linear(x, weight, b)
    ref = x.double() @ dense.to(act).double().T + b.double()
    assert y.dtype == act and ((y.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[act]


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,target,group", W8A8)
def test_w8a8_accuracy(act, fmt, target, group):
    weight, dense = quantized_weight(fmt, act)
    x = torch.randn(37, K).to(act)
    q, scale = quantize_activations(x, target, group)
    x_dense = (q.double().unflatten(1, (scale.shape[1], -1)) * scale.double()[..., None]).flatten(1)
    y = quantized_linear(q, weight, x_scale=scale, out_dtype=act)
    ref = x_dense @ dense.T
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[act]


def _assert_rows_invariant(run, act):
    pool = torch.randn(max(BATCH_SIZES), K).to(act)
    alone = [run(pool[i:i + 1])[0] for i in range(4)]
    for m in BATCH_SIZES:
        for pos in sorted({0, m // 2, m - 1}):
            i = (m + pos) % 4
            batch = pool[torch.randperm(pool.shape[0])[:m]].clone()
            batch[pos] = pool[i]
            assert torch.equal(run(batch)[pos], alone[i]), f"M={m} pos={pos}"


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["int4", "int4_asym", "packed8", "fp8"])
def test_weight_only_row_alone_equals_row_in_any_batch(act, fmt):
    weight, _ = quantized_weight(fmt, act)
    b = torch.randn(N).to(act)
    _assert_rows_invariant(lambda x: quantized_linear(x, weight, b), act)


@pytest.mark.fast_cells(2)
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,target,group", W8A8)
def test_w8a8_row_alone_equals_row_in_any_batch(act, fmt, target, group):
    weight, _ = quantized_weight(fmt, act)
    b = torch.randn(N).to(act)
    _assert_rows_invariant(lambda x: _run_w8a8(x, weight, target, group, b), act)


def test_negative_control_per_tensor_activation_scale_breaks_invariance():
    """The same GEMM fed a per-tensor dynamic scale (the max over the batch): rows change with their batch."""
    weight, _ = quantized_weight("fp8", torch.bfloat16)
    x = torch.randn(8, K).bfloat16()
    x[3] *= 40

    def per_tensor(x):
        scale = (x.float().abs().amax() / 448).reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return quantized_linear((x.float() / scale).to(torch.float8_e4m3fn), weight, x_scale=scale,
                                out_dtype=torch.bfloat16)
    batched = per_tensor(x)
    assert not all(torch.equal(per_tensor(x[i:i + 1])[0], batched[i]) for i in (0, 1, 2))
    fixed = _run_w8a8(x, weight, torch.float8_e4m3fn, None)
    assert all(torch.equal(_run_w8a8(x[i:i + 1], weight, torch.float8_e4m3fn, None)[0], fixed[i]) for i in range(8))


def test_negative_control_m_dependent_block_k_breaks_invariance():
    weight, _ = quantized_weight("int4", torch.float16)
    x = torch.randn(8, K).half()
    pick = lambda x: QuantizedLinearConfig(64, 64, 16 if x.shape[0] <= 4 else 64)  # noqa: E731
    batched = quantized_linear(x, weight, config=pick(x)).float()
    # fp32 sums regrouped by BLOCK_K: visible after the fp16 rounding in some element of some row
    alone = [quantized_linear(x[i:i + 1], weight, config=pick(x[i:i + 1]))[0].float() for i in range(8)]
    assert not all(torch.equal(a, batched[i]) for i, a in enumerate(alone))


def test_config_never_depends_on_m():
    import inspect
    assert list(inspect.signature(quantized_linear_config).parameters) == ["device_type", "weight"]


def test_rejects_mismatched_operands():
    weight, _ = quantized_weight("int4", torch.bfloat16)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        quantized_linear(torch.randn(2, K), weight)
    with pytest.raises(TypeError, match="take"):
        quantized_linear(torch.randn(2, K).bfloat16(), quantized_weight("fp8", torch.bfloat16)[0], x_scale=torch.ones(2, 1))


def _k_shard(weight, begin, end):
    """The columns [begin, end) of a weight, sliced as tensor parallelism shards a row-parallel layer."""
    n, _ = weight.shape
    per_word = 32 // weight.bits if weight.format == "packed" else 1
    g = weight.scale_group_k
    zero = None if weight.zero_point is None else weight.zero_point[:, begin // g:end // g]
    return replace(weight, data=weight.data[:, begin // per_word:end // per_word], scale=weight.scale[:, begin // g:end // g],
                   shape=(n, end - begin), zero_point=zero)


@pytest.mark.parametrize("fmt,target", [("int4", None), ("int4_asym", None), ("packed8", None),
                                        ("fp8_block", torch.float8_e4m3fn)])
def test_partials_split_across_ranks_equal_the_tree(fmt, target):
    """A row-parallel layer's tree: each rank's leaves computed from its K shard alone and combined
    in leaf order give the one-process tree's bits, for every size dividing the leaves; a split
    that reduces each shard as one chunk (a TP-dependent tree) does not."""
    weight, dense = quantized_weight(fmt, torch.bfloat16)
    leaves = quantized_tree_leaves(weight)
    assert leaves == K // weight.scale_group_k  # K = 256: every group its own leaf, at most 8
    x, b = torch.randn(9, K).bfloat16(), torch.randn(N).bfloat16()
    q, scale = quantize_activations(x, target, 128) if target else (x, None)
    tree = combine_partials(quantized_linear_partials(q, weight, leaves, x_scale=scale), b, torch.bfloat16)
    x_dense = (q.double().unflatten(1, (2, -1)) * scale.double()[..., None]).flatten(1) if target else x.double()
    ref = x_dense @ dense.to(torch.bfloat16).double().T if not target else x_dense @ dense.T
    assert ((tree.double() - ref - b.double()).abs().max() / ref.abs().max()).item() < TOLERANCE[torch.bfloat16]
    for t in [s for s in (1, 2, 4) if leaves % s == 0]:
        s = K // t
        shards = [(r * s, (r + 1) * s) for r in range(t)]
        parts = torch.cat([quantized_linear_partials(q[:, lo:hi], _k_shard(weight, lo, hi), leaves // t,
                                                     x_scale=None if scale is None else scale[:, lo // 128:hi // 128])
                           for lo, hi in shards])
        assert torch.equal(combine_partials(parts, b, torch.bfloat16), tree), t
    if K // quantized_linear_config("cpu", weight).block_k <= 2:
        return  # two K tiles: any split into two chunks is the tile sum itself (the int4 cells show the control)
    halves = [(0, K // 2), (K // 2, K)]
    one_chunk = torch.cat([quantized_linear_partials(q[:, lo:hi], _k_shard(weight, lo, hi), 1,
                                                     x_scale=None if scale is None else scale[:, lo // 128:hi // 128])
                           for lo, hi in halves])
    whole = quantized_linear_partials(q, weight, 1, x_scale=scale)  # TP 1 reducing its shard, all of K, as one chunk
    assert not torch.equal(combine_partials(one_chunk, None, torch.float32), combine_partials(whole, None, torch.float32))


def test_partials_refuse_per_channel_weights_and_split_groups():
    with pytest.raises(ValueError, match="group or block"):
        quantized_linear_partials(torch.randn(2, K).bfloat16(), quantized_weight("fp8", torch.bfloat16)[0], 2)
    with pytest.raises(ValueError, match="whole scale groups"):
        quantized_linear_partials(torch.randn(2, K).bfloat16(), quantized_weight("packed8", torch.bfloat16)[0], 4)


def _packed(bits, n, k, group, seed=0):
    """A packed weight of random integers and scales, and its dequantized values in float64."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // (group or k), generator=g) / 8 + 0.01).bfloat16()
    dense = q.double() * scale.double().repeat_interleave(group or k, 1)
    return QuantizedWeight("packed", pack_to_int32(q, bits), scale, (n, k), bits=bits, group_size=group), dense


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_tiles_unpack_in_order_on_partial_tiles_and_across_scale_groups(bits):
    """The words of a packed tile are loaded once and unpacked in registers: element k of word
    k // per_word at bits (k % per_word) * bits, through a K tail shorter than a tile (K = 200,
    per channel) and through a custom config whose K tile spans two scale groups (one scale column
    per k instead of one per tile)."""
    tail, dense = _packed(bits, 96, 200, None)
    assert quantized_linear_config("cpu", tail).block_k == 128 and torch.equal(dequantize_weight(tail),
                                                                                 dense.bfloat16())
    grouped, dense = _packed(bits, 96, 256, 64, seed=1)
    x = torch.randn(5, 256).bfloat16()
    ref = x.double() @ dense.bfloat16().double().T
    for config in (None, QuantizedLinearConfig(64, 64, 128)):  # BLOCK_K 64 (one scale column), then 128 (two)
        y = quantized_linear(x, grouped, config=config)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[torch.bfloat16]
    # control: the same integers read with the scale groups swapped pairwise are far off
    swapped = replace(grouped, scale=grouped.scale[:, [1, 0, 3, 2]].contiguous())
    y = quantized_linear(x, swapped, config=QuantizedLinearConfig(64, 64, 128))
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() > 10 * TOLERANCE[torch.bfloat16]


def test_fp8_launchers_refuse_gpus_before_compute_capability_8_9(monkeypatch):
    """On a GPU of compute capability below 8.9 (faked: there is no GPU here) every fp8 launch is
    refused by name before anything compiles; int8 and packed launches run."""
    from invariant_infer.kernels import fp8_support
    from invariant_infer.kernels.errors import UnsupportedOperationError
    from invariant_infer.kernels.grouped_quantized_linear import grouped_quantized_linear
    monkeypatch.setattr(fp8_support, "device_capability", lambda device: (8, 0))
    x = torch.randn(3, K).bfloat16()
    fp8, _ = quantized_weight("fp8", torch.bfloat16)
    stacked = replace(fp8, data=fp8.data[None], scale=fp8.scale[None])
    calls = [lambda: quantize_activations(x, torch.float8_e4m3fn),
             lambda: quantized_linear(x, fp8),
             lambda: quantized_linear(x.to(torch.float8_e4m3fn), fp8, x_scale=torch.ones(3, 1), out_dtype=x.dtype),
             lambda: dequantize_weight(fp8),
             lambda: grouped_quantized_linear(x, stacked, torch.tensor([0, 3]))]
    for call in calls:
        with pytest.raises(UnsupportedOperationError, match="compute capability 8.0: make_invariant does not run FP8"):
            call()
    q, scale = quantize_activations(x, torch.int8)  # control: int8 runs on such a GPU
    int8 = quantized_weight("int8", torch.bfloat16)[0]
    assert quantized_linear(q, int8, x_scale=scale, out_dtype=x.dtype).shape == (3, N)
    monkeypatch.setattr(fp8_support, "device_capability", lambda device: (8, 9))
    assert quantize_activations(x, torch.float8_e4m3fn)[0].dtype == torch.float8_e4m3fn


def test_the_capability_is_read_once_per_device(monkeypatch):
    from invariant_infer.kernels import fp8_support
    reads = []
    monkeypatch.setattr(fp8_support, "_CAPABILITIES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: reads.append(index) or (8, 0))
    for _ in range(3):
        assert fp8_support.device_capability(torch.device("cuda", 1)) == (8, 0)
    assert reads == [1] and fp8_support.device_capability(torch.device("cpu")) is None


# Two K chunks of 128 (whole scale groups in every format), each two BLOCK_Ks of 64: the K tree a
# GPU config cuts, at this test's small K.
SPLIT_K = QuantizedLinearConfig(64, 64, 64, k_chunks=2, chunk_k=128)
FORMATS = [(fmt, None, None) for fmt in WEIGHT_ONLY] + W8A8


@pytest.mark.fast_cells(ids=["int4_asym", "fp8-w8a8", "fp8_block-w8a8"])  # the others in the heavy tier
@pytest.mark.parametrize("fmt,target,group", FORMATS, ids=[case[0] + ("-w8a8" if case[1] else "") for case in FORMATS])
def test_split_k_schedules_give_the_same_bits(fmt, target, group):
    """Each format's K chunks on the parallel schedule (split-K partials, then the combine with the
    per-token / per-channel scales and the bias) and the sequential one (one loop, a flush at each
    chunk's end) give the same bits, for a row alone and in a batch; the chunked tree is another
    sum than one chunk over all of K (so the chunks are real; int8 x int8 sums are exact), and
    stays accurate."""
    weight, dense = quantized_weight(fmt, torch.bfloat16)
    x, b = torch.randn(7, K).bfloat16(), torch.randn(N).bfloat16()
    q, scale = quantize_activations(x, target, group) if target else (x, None)

    def run(rows, config=SPLIT_K, parallel=None):
        return quantized_linear(q[rows], weight, b, x_scale=None if scale is None else scale[rows],
                                out_dtype=torch.bfloat16, config=config, parallel_chunks=parallel)
    sequential = run(slice(None), parallel=False)
    assert torch.equal(run(slice(None), parallel=True), sequential)
    assert torch.equal(run(slice(3, 4), parallel=True)[0], sequential[3])
    unsplit = QuantizedLinearConfig(64, 64, 64)
    exact = lambda config: quantized_linear(q, weight, x_scale=scale, out_dtype=torch.float32, config=config)  # noqa: E731
    # int8 x int8 chunk sums are exact integers (here under 2**24, so exact in fp32 too): no tree moves them
    assert torch.equal(exact(SPLIT_K), exact(unsplit)) == (target == torch.int8)
    x_dense = (q.double().unflatten(1, (scale.shape[1], -1)) * scale.double()[..., None]).flatten(1) if target else x.double()
    ref = x_dense @ (dense.T if target else dense.to(torch.bfloat16).double().T) + b.double()
    assert ((sequential.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[torch.bfloat16]


def test_split_k_refuses_chunks_that_split_a_scale_group():
    weight, _ = quantized_weight("fp8_block", torch.bfloat16)
    with pytest.raises(ValueError, match="whole scale groups"):
        quantized_linear(torch.randn(2, K).bfloat16(), weight, config=QuantizedLinearConfig(64, 64, 64, k_chunks=4,
                                                                                           chunk_k=64))
