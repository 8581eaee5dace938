"""transformers' own ``fp8`` checkpoints (``weight_block_size`` [128, 128], ``weight_scale_inv``, as
the official Qwen3 FP8 checkpoints): loaded with from_pretrained, kept in fp8, bitwise batch-invariant.

Without a GPU, transformers dequantizes such a checkpoint to bf16 at load; ``quantized_loading()``
keeps its FP8Linear layers on CPU as a GPU load keeps them. The plain CPU load is the reference for
transformers' own dequantization."""
import copy
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.controls import per_tensor_scaled_quantized_forward
from helpers.models import batch_mismatches, make_samples
from invariant_infer import make_invariant
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.kernels import dequantize_weight
from invariant_infer.model.quantization import quantized_layers, weight_bytes
from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint
from invariant_infer.testing.random_checkpoints import qwen2_config

DTYPES = [torch.bfloat16, torch.float16]
CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
              num_hidden_layers=1)
# Max |logit - float64 reference| / max |reference|; the reference has the dequantized weights but
# full-precision activations, which the fp8 path quantizes to e4m3 (3 mantissa bits) per 128-group.
LOGIT_TOLERANCE = 0.08  # measured 0.035 (bf16, fp16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {d: save_fp8_checkpoint(root / str(d).replace("torch.", ""), qwen2_config("tiny", **CONFIG), dtype=d)
            for d in DTYPES}


def _load(path, dtype=torch.bfloat16, device="cpu"):
    with quantized_loading():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_bitwise_equal_alone_and_in_any_batch(checkpoints, dtype):
    model = make_invariant(_load(checkpoints[dtype], dtype))
    assert len(quantized_layers(model)) == 7
    with torch.no_grad():
        assert batch_mismatches(model, make_samples(model.config.vocab_size)) == []




def test_negative_control_per_tensor_activation_scale_is_caught(checkpoints):
    samples = make_samples(512)
    model = make_invariant(_load(checkpoints[torch.bfloat16]))
    for module in quantized_layers(model):
        module.forward = types.MethodType(per_tensor_scaled_quantized_forward, module)
    with torch.no_grad():
        assert batch_mismatches(model, samples)


def test_weights_stay_fp8(checkpoints):
    model = _load(checkpoints[torch.bfloat16])
    stored = weight_bytes(model)
    make_invariant(model)
    with torch.no_grad():
        model(torch.arange(5)[None])
    assert weight_bytes(model) == stored
    dense = AutoModelForCausalLM.from_pretrained(checkpoints[torch.bfloat16], dtype=torch.bfloat16)
    assert stored < weight_bytes(dense)
    for module in quantized_layers(model):
        assert module.weight.dtype == torch.float8_e4m3fn
        assert module.__dict__["forward"].__func__.__name__ == "quantized_forward"


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantization_equals_transformers_and_logits_match_float64(checkpoints, dtype):
    # transformers' own dequantization: without a GPU, the plain load turns each FP8Linear into a Linear
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[dtype], dtype=dtype).eval()
    modules = dict(reference.named_modules())
    model = _load(checkpoints[dtype], dtype)
    names = {module: name for name, module in model.named_modules()}
    for module, plan in quantized_layers(model).items():
        assert type(modules[names[module]]) is torch.nn.Linear
        assert torch.equal(dequantize_weight(plan.weight).to(dtype), modules[names[module]].weight.data)
    ref64 = copy.deepcopy(reference).double()
    make_invariant(model)
    ids = torch.stack(make_samples(model.config.vocab_size, lengths=(12, 12)))
    with torch.no_grad():
        got, want = model(ids).logits.double(), ref64(ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < LOGIT_TOLERANCE


def _with_config(model, **fields):
    model.config.quantization_config = {**model.config.quantization_config.to_dict(), **fields}
    return model


def _with_layers(model, **fields):
    for name, module in model.named_modules():
        if type(module).__name__ == "FP8Linear":
            for key, value in fields.items():
                setattr(module, key, value)
    return model


@pytest.mark.parametrize("mutate,match", [
    (lambda m: _with_config(m, dequantize=True), "dequantize=True"),
    (lambda m: _with_config(m, scale_fmt="ue8m0"), "MXFP8"),
    (lambda m: _with_layers(m, activation_scheme="static"), "static activation scales"),
    (lambda m: _with_layers(m, block_size=[64, 64]), r"blocks \[64, 64\]"),
])
def test_refusals_name_the_problem_and_the_supported_list(checkpoints, mutate, match):
    with pytest.raises(UnsupportedModelError, match=match) as refused:
        make_invariant(mutate(_load(checkpoints[torch.bfloat16])))
    assert "weight_block_size [128, 128]" in str(refused.value) or "dequantize" in str(refused.value)


@pytest.mark.gpu
def test_gpu_load_keeps_fp8_layers_and_rows_are_invariant(checkpoints):
    """On a GPU transformers keeps FP8Linear by itself (no context needed)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints[torch.bfloat16], dtype=torch.bfloat16,
                                                 device_map="cuda").eval()
    model = make_invariant(model)
    assert len(quantized_layers(model)) == 7
    samples = [s.cuda() for s in make_samples(model.config.vocab_size)]
    with torch.no_grad():
        assert batch_mismatches(model, samples) == []
