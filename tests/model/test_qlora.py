"""QLoRA: PEFT LoRA adapters, unmerged, on a quantized base (compressed-tensors W4A16_ASYM and FP8_BLOCK,
written with compressed-tensors' own compressors, and transformers' own ``fp8`` format, FP8Linear layers).
Bitwise batch invariance of the logits and of the input gradients, deterministic adapter gradients, the
input gradient of the frozen quantized linear against float64, the engine's adapter slots on a quantized
base, refusals, and negative controls."""
import importlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from helpers.controls import per_tensor_scaled_quantized_forward
from helpers.models import BATCHINGS, batch_mismatches, make_samples
from invariant_infer import make_invariant, pad_sequences, score_sequences
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.engine import Engine
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.kernels import LinearConfig, dequantize_weight, linear, linear_config
from invariant_infer.model import quantization
from invariant_infer.model.quantization import prepare_for_peft
from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint, save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import qwen2_config
from invariant_infer.model.module_state import state_of

import compressed_tensors  # noqa: E402,F401  (the test extra pins it: a missing install fails, never skips)

FORMATS = ["W4A16_ASYM", "FP8_BLOCK"]
CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
              num_hidden_layers=1, vocab_size=512)
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
LENGTHS = (5, 1, 7, 3)  # samples for BATCHINGS[1:3]
# the module (the package exports its function under the same name)
autograd_module = importlib.import_module("invariant_infer.kernels.quantized_linear_autograd")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    paths = {fmt: save_quantized_checkpoint(root / fmt, qwen2_config("tiny", **CONFIG), fmt, seed=3) for fmt in FORMATS}
    paths["fp8"] = save_fp8_checkpoint(root / "fp8", qwen2_config("tiny", **CONFIG), seed=3)
    return paths


def base_model(path):
    with quantized_loading():
        return prepare_for_peft(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))


def qlora_model(path, seed=0):
    """A quantized base with one random (nonzero) LoRA adapter, patched, unmerged."""
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    return make_invariant(get_peft_model(base_model(path), config)).eval()


def _shifts_logits(model, samples):
    ids = samples[0][None]
    with torch.no_grad():
        on = model(input_ids=ids).logits
        with model.disable_adapter():
            off = model(input_ids=ids).logits
    return not torch.equal(on, off)


# left padding with extra pads in reversed order, and right padding (the fp8 interpreter is slower: one)
@pytest.mark.fast_cells(1)
@pytest.mark.parametrize(("fmt", "batchings"), [("W4A16_ASYM", BATCHINGS[1:3]), ("FP8_BLOCK", BATCHINGS[1:2]),
                                               ("fp8", BATCHINGS[1:2])], ids=[*FORMATS, "fp8"])
def test_qlora_logits_bitwise_batch_invariant(checkpoints, fmt, batchings):
    model = qlora_model(checkpoints[fmt])
    lora_a = model.get_base_model().model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert lora_a.dtype == torch.float32 and not torch.equal(lora_a, lora_a.to(torch.float8_e4m3fn).float())
    samples = make_samples(model.config.vocab_size, lengths=LENGTHS)
    assert _shifts_logits(model, samples)  # the adapter is live
    assert batch_mismatches(model, samples, batchings) == []




@pytest.mark.parametrize("fmt", ["FP8_BLOCK", "fp8"])
def test_negative_control_per_tensor_activation_scale_is_caught(checkpoints, fmt, monkeypatch):
    """The base layers under the adapter with a per-tensor dynamic scale: the same check catches it."""
    model = qlora_model(checkpoints[fmt])
    monkeypatch.setattr(quantization, "_quantized_forward", per_tensor_scaled_quantized_forward)
    assert batch_mismatches(model, make_samples(model.config.vocab_size, lengths=LENGTHS), BATCHINGS[1:2])


# ---- training ---------------------------------------------------------------------------------------

def _embeds_grads(model, samples, members, cotangents):
    """(input-embedding grads per member, {LoRA parameter: grad}) of one left-padded batch."""
    model.zero_grad(set_to_none=True)
    ids, mask = pad_sequences([samples[i] for i in members], side="left")
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, attention_mask=mask).logits
    loss = sum((logits[row][mask[row].bool()].float() * cotangents[i]).sum() for row, i in enumerate(members))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return [embeds.grad[row][mask[row].bool()] for row in range(len(members))], grads


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("fmt", [*FORMATS, "fp8"])
def test_train_mode_input_grads_batch_invariant_and_adapter_grads_deterministic(checkpoints, fmt):
    model = qlora_model(checkpoints[fmt]).train()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    samples = make_samples(model.config.vocab_size, lengths=(4, 2))
    g = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(len(s), model.config.vocab_size, generator=g) for s in samples]
    alone = [_embeds_grads(model, samples, (i,), cotangents)[0][0] for i in range(len(samples))]
    batched, grads = _embeds_grads(model, samples, (0, 1), cotangents)
    assert all(torch.equal(batched[i], alone[i]) for i in range(len(samples)))
    assert all(a.abs().sum() > 0 for a in alone)
    again = _embeds_grads(model, samples, (0, 1), cotangents)[1]
    assert grads.keys() == trainable and all(torch.equal(grads[n], again[n]) for n in grads)
    assert all(grads[n].abs().sum() > 0 for n in grads)


def _layer_grad(layer, x, cotangent):
    x = x.clone().requires_grad_()
    (layer(x).float() * cotangent).sum().backward()
    return x.grad


@pytest.mark.parametrize("fmt", [*FORMATS, "fp8"])
def test_quantized_linear_input_grad_rows_alone_and_float64(checkpoints, fmt):
    """dX of one frozen quantized layer: each row alone equals its row in the batch, and
    dX = dY @ dequant(W) within bf16 rounding of a float64 reference."""
    model = qlora_model(checkpoints[fmt])
    layer = model.get_base_model().model.layers[0].mlp.up_proj.base_layer
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, layer.in_features, generator=g).to(torch.bfloat16)
    dy = torch.randn(6, layer.out_features, generator=g).to(torch.bfloat16)
    batched = _layer_grad(layer, x, dy)
    assert all(torch.equal(_layer_grad(layer, x[i:i + 1], dy[i:i + 1])[0], batched[i]) for i in range(6))
    dense = dequantize_weight(state_of(layer).quantized.weight).double()
    want = dy.double() @ dense
    assert (batched.double() - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_negative_control_rows_dependent_input_grad_is_caught(checkpoints, monkeypatch):
    """A dX whose reduction over N is split by the rows of the batch: the same check catches it."""
    model = qlora_model(checkpoints["W4A16_ASYM"])
    layer = model.get_base_model().model.layers[0].mlp.up_proj.base_layer

    def rows_dependent(grad_y2, weight, config=None):
        base = linear_config(grad_y2.device.type, grad_y2.dtype, *weight.t().shape)
        return linear(grad_y2, weight.t(), config=LinearConfig(base.block_m, base.block_n, 16,
                                                               k_chunks=4 if grad_y2.shape[0] < 4 else 1))
    monkeypatch.setattr(autograd_module, "grad_input", rows_dependent)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, layer.in_features, generator=g).to(torch.bfloat16)
    dy = torch.randn(6, layer.out_features, generator=g).to(torch.bfloat16)
    batched = _layer_grad(layer, x, dy)
    assert not all(torch.equal(_layer_grad(layer, x[i:i + 1], dy[i:i + 1])[0], batched[i]) for i in range(6))


def test_trainable_quantized_weight_and_merging_refused(checkpoints):
    model = qlora_model(checkpoints["FP8_BLOCK"]).train()
    model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight_scale.requires_grad_(True)
    with pytest.raises(UnsupportedModelError, match="quantized weights are frozen.*weight_scale"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    with pytest.raises(UnsupportedModelError, match="merging a LoRA adapter into a quantized base"):
        model.merge_and_unload()


# ---- the engine -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["W4A16_ASYM", "fp8"])
def test_engine_adapter_on_quantized_base_equals_peft_scoring(checkpoints, fmt):
    path = checkpoints[fmt]
    peft_model = qlora_model(path)
    engine = Engine(make_invariant(base_model(path).eval()), max_loras=2, max_lora_rank=8)
    engine.add_lora("a", peft_model)
    sequences = [s.tolist() for s in make_samples(CONFIG["vocab_size"], lengths=(6, 4), seed=5)]
    want = score_sequences(peft_model, sequences)
    got = engine.score(sequences, lora="a")
    assert all(torch.equal(g.token_logprobs, w.token_logprobs) for g, w in zip(got, want))
    base = engine.score(sequences)
    assert not torch.equal(base[0].token_logprobs, got[0].token_logprobs)
