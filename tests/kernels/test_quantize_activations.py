"""Per-token activation quantization: compressed-tensors' values, and a row depends on itself alone."""
import pytest
import torch

from invariant_infer.kernels.quantize_activations import quantize_activations

TARGETS = [torch.float8_e4m3fn, torch.int8]


def _bits(q):
    return q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("group", [None, 128])
def test_matches_compressed_tensors_fake_quantization(act, target, group):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    x = (torch.randn(6, 256) * 3).to(act)
    x[2] = 0  # an all-zero row: the scale becomes the dtype's epsilon
    q, scale = quantize_activations(x, target, group)
    args = QuantizationArgs(num_bits=8, type="float" if target == torch.float8_e4m3fn else "int",
                            strategy="token" if group is None else "group", group_size=group, dynamic=True)
    ct_scale, ct_zp = compute_dynamic_scales_and_zp(x[None], args, module=None)
    expected = fake_quantize(x[None], ct_scale, ct_zp, args)[0]
    dequantized = (q.float().unflatten(1, (scale.shape[1], -1)) * scale[..., None]).flatten(1).to(act)
    assert torch.equal(dequantized, expected)
    assert torch.equal(scale, ct_scale[0].float().reshape(scale.shape))


@pytest.mark.parametrize("target", TARGETS)
def test_row_alone_equals_row_in_any_batch(target):
    pool = torch.randn(40, 192).bfloat16() * torch.logspace(-2, 2, 40)[:, None].bfloat16()
    q, scale = quantize_activations(pool, target)
    for i in (0, 17, 39):
        q1, s1 = quantize_activations(pool[i:i + 1], target)
        assert torch.equal(_bits(q1[0]), _bits(q[i])) and torch.equal(s1[0], scale[i])


def test_negative_control_per_tensor_scale_is_batch_variant():
    """A per-tensor dynamic scale (the max over every token) changes a row's values with its neighbours."""
    pool = torch.randn(8, 128).bfloat16()
    pool[5] *= 50
    per_tensor = lambda x: (x.float() / (x.float().abs().amax() / 448)).to(torch.float8_e4m3fn)  # noqa: E731
    assert not torch.equal(_bits(per_tensor(pool[:1])[0]), _bits(per_tensor(pool)[0]))
    assert torch.equal(_bits(quantize_activations(pool[:1], torch.float8_e4m3fn)[0][0]),
                       _bits(quantize_activations(pool, torch.float8_e4m3fn)[0][0]))


def test_rejects_other_dtypes():
    with pytest.raises(TypeError, match="target dtype"):
        quantize_activations(torch.randn(2, 16).bfloat16(), torch.float16)
    with pytest.raises(TypeError, match="activations"):
        quantize_activations(torch.randn(2, 16), torch.int8)
