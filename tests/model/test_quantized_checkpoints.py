"""Compressed-tensors checkpoints: loaded with from_pretrained, kept compressed, bitwise batch-invariant.

Checkpoints are written with compressed-tensors' own compressors (``testing.quantized_checkpoints``)."""
import copy
import dataclasses
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.models import batch_mismatches, make_samples
from invariant_infer import make_invariant
from invariant_infer.checkpoints.quantized import packed_zero_points
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.kernels import dequantize_weight
from invariant_infer.model.patch import restore
from invariant_infer.model.quantization import quantized_layers, weight_bytes
from invariant_infer.testing.quantized_checkpoints import save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import qwen2_config

import compressed_tensors  # noqa: E402,F401  (the test extra pins it: a missing install fails, never skips)

# FP8: a static activation scale; *_ASYM: asymmetric packed weights (zero points per group)
SCHEMES = ["FP8_DYNAMIC", "W8A8", "W4A16", "W8A16", "W4A16_ASYM", "W8A16_ASYM", "FP8_BLOCK", "FP8"]
DTYPES = [torch.bfloat16, torch.float16]
# Every K a multiple of 128 (group and block formats); one layer keeps the interpreter quick.
CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
              num_hidden_layers=1)
# Max |logit - float64 reference| / max |reference|. The reference uses the dequantized weights,
# so weight-only schemes differ only by bf16/fp16 rounding; W8A8 schemes also quantize activations
# to 8 bits (fp8 e4m3: 3 mantissa bits), which the float64 reference does not.
LOGIT_TOLERANCE = {"W4A16": 0.03, "W8A16": 0.03, "W4A16_ASYM": 0.03, "W8A16_ASYM": 0.03, "FP8_DYNAMIC": 0.15, "FP8_BLOCK": 0.15, "FP8": 0.15, "W8A8": 0.08}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    config = qwen2_config("tiny", **CONFIG)
    paths = {(s, d): save_quantized_checkpoint(root / f"{s}-{d}".replace("torch.", ""), config, s, dtype=d)
             for s in SCHEMES for d in DTYPES}
    paths["per-tensor"] = save_quantized_checkpoint(root / "per-tensor", config, "FP8_DYNAMIC", strategy="tensor")
    return paths


def _load(path, dtype=torch.bfloat16):
    with packed_zero_points():  # asymmetric packed checkpoints: the zero points load as stored
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# Every scheme in both activation dtypes; the fast tier runs FP8_BLOCK in bf16 (the accuracy test below
# runs every scheme there).
INVARIANCE_CELLS = [pytest.param(scheme, dtype, id=f"{scheme}-{str(dtype).removeprefix('torch.')}")
                    for scheme in SCHEMES for dtype in DTYPES]


@pytest.mark.fast_cells(ids=["FP8_BLOCK-bfloat16"])
@pytest.mark.parametrize("scheme, dtype", INVARIANCE_CELLS)
def test_rows_bitwise_equal_alone_and_in_any_batch(checkpoints, scheme, dtype):
    model = make_invariant(_load(checkpoints[scheme, dtype], dtype))
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size)) == []


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_stay_compressed(checkpoints, scheme):
    model = _load(checkpoints[scheme, torch.bfloat16])
    stored = weight_bytes(model)
    make_invariant(model)
    assert not hasattr(model, "ct_decompress_hook")
    with torch.no_grad():
        model(torch.arange(5)[None])
    assert weight_bytes(model) == stored
    dense = AutoModelForCausalLM.from_config(model.config.__class__(**{**model.config.to_dict(),
                                                                      "quantization_config": None}))
    assert stored < weight_bytes(dense.to(torch.bfloat16))
    for module in quantized_layers(model):
        assert module.__dict__["forward"].__func__.__name__ == "quantized_forward"
        assert getattr(module, "weight", None) is None or module.weight.dtype in (torch.float8_e4m3fn, torch.int8)


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "W4A16_ASYM"])
def test_a_forward_with_autograd_on_needs_no_no_grad(checkpoints, scheme):
    """from_pretrained marks every tensor trainable; make_invariant freezes the compressed ones, so a
    plain forward (no torch.no_grad) runs and gives the no_grad logits; one made trainable again is
    refused by name."""
    model = make_invariant(_load(checkpoints[scheme, torch.bfloat16]))
    ids = torch.arange(5)[None]
    with torch.no_grad():
        expected = model(ids).logits
    assert torch.equal(model(ids).logits.detach(), expected)
    layer = next(iter(quantized_layers(model)))
    layer.weight_scale.requires_grad_(True)
    with pytest.raises(UnsupportedModelError, match="quantized weights are frozen.*weight_scale"):
        model(ids)


def _decompressed(path, dtype):
    """The stock model with compressed-tensors' own decompression applied (its first-forward hook)."""
    from compressed_tensors.compressors.base import decompress_module
    model = _load(path, dtype)
    plans = quantized_layers(model)
    names = {module: name for name, module in model.named_modules()}
    for module in plans:
        decompress_module(module)
    return model, {names[m]: p for m, p in plans.items()}


@pytest.mark.fast_cells(8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantization_equals_compressed_tensors_and_logits_match_float64(checkpoints, scheme, dtype):
    path = checkpoints[scheme, dtype]
    reference, plans = _decompressed(path, dtype)
    modules = dict(reference.named_modules())
    for name, plan in plans.items():
        assert torch.equal(dequantize_weight(plan.weight), modules[name].weight.data), name
        if plan.weight.zero_point is not None:  # the zero points matter: without them the values differ
            symmetric = dataclasses.replace(plan.weight, zero_point=None)
            assert not torch.equal(dequantize_weight(symmetric), modules[name].weight.data), name
    # float64 model with the dequantized weights (and everything else as stored)
    ref64 = AutoModelForCausalLM.from_config(copy.deepcopy(reference.config)).double().eval()
    ref64.config.quantization_config = None
    state = {k: v for k, v in reference.state_dict().items() if k in ref64.state_dict()}
    ref64.load_state_dict({k: v.double() for k, v in state.items()})
    model = make_invariant(_load(path, dtype))
    ids = torch.stack(make_samples(model.config.vocab_size, lengths=(12, 12)))
    with torch.no_grad():
        got, want = model(ids).logits.double(), ref64(ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < LOGIT_TOLERANCE[scheme]


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
def test_negative_control_per_tensor_dynamic_scale(checkpoints):
    """Stock compressed-tensors with a per-tensor dynamic activation scale: rows change with their batch.
    make_invariant replaces it by a per-token scale (warning), or refuses it with strict=True."""
    samples = make_samples(512)
    stock = _load(checkpoints["per-tensor"])
    with torch.no_grad():
        stock(torch.arange(3)[None])  # the first forward decompresses (compressed-tensors' hook)
        assert batch_mismatches(stock, samples)
    with pytest.raises(UnsupportedModelError, match="per-tensor activation scale"):
        make_invariant(_load(checkpoints["per-tensor"]), strict=True)
    with pytest.warns(UserWarning, match="per-token scale instead"):
        model = make_invariant(_load(checkpoints["per-tensor"]))
    with torch.no_grad():
        assert batch_mismatches(model, samples) == []


def test_asymmetric_zero_points_load_packed_as_stored(checkpoints):
    """transformers 5.24 builds them unpacked and stops on a size mismatch; in packed_zero_points()
    (5.17 also without) they load as the file stores them."""
    from safetensors.torch import load_file
    path = checkpoints["W4A16_ASYM", torch.bfloat16]
    stored = {k: v for k, v in load_file(path / "model.safetensors").items() if k.endswith("weight_zero_point")}
    loaded = _load(path).state_dict()
    assert len(stored) == 7
    for name, zero_point in stored.items():
        assert zero_point.dtype == torch.int32 and torch.equal(loaded[name], zero_point), name


def test_restore_gives_back_the_stock_model(checkpoints):
    path = checkpoints["W4A16", torch.bfloat16]
    model, stock = _load(path), _load(path)
    ids = torch.arange(6)[None]
    restore(make_invariant(model))
    with torch.no_grad(), warnings.catch_warnings():
        assert torch.equal(model(ids).logits, stock(ids).logits)


def _with_config(model, **fields):
    model.config.quantization_config = {**model.config.quantization_config.to_dict(), **fields}
    return model


def _with_weight_args(model, **fields):
    for module in quantized_layers(model):
        scheme = module.quantization_scheme
        module.quantization_scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update=fields)})
    return model


@pytest.mark.parametrize("mutate,match", [
    (lambda m: _with_config(m, quant_method="gptq"), "quantization method 'gptq'"),
    (lambda m: _with_config(m, kv_cache_scheme={"num_bits": 8, "type": "float"}), "quantized KV-cache"),
    (lambda m: _with_config(m, sparsity_config={"format": "sparse-24-bitmask"}), "sparsity"),
    (lambda m: _with_weight_args(m, type="float", num_bits=4), "NVFP4/MXFP4"),
    (lambda m: _with_weight_args(m, actorder="group"), "actorder with g_idx"),
    (lambda m: _with_weight_args(m, symmetric=False), "asymmetric"),
])
def test_refusals_name_the_problem_and_the_supported_list(checkpoints, mutate, match):
    model = mutate(_load(checkpoints["W4A16", torch.bfloat16]))
    with pytest.raises(UnsupportedModelError, match=match) as refused:
        make_invariant(model)
    assert "FP8_DYNAMIC" in str(refused.value)
