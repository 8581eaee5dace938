"""``audit(model)`` and ``make_invariant(model, strict=True)``: every supported kind's patched forward
runs every float reduction on the invariant kernels (each family and dtype, vision-language with
images, each quantized format, PEFT LoRA, tensor parallelism), and the audit leaves the model as it was.
Negative controls: each kind's stock forward is reported; a forward hook's mm and a pre-hook's float sum
are reported with their module's name and refused by strict (an integer sum is not); the allowance
table refuses what is exact only by convenience (a float sum, a softmax over three values, add with an
alpha, an accumulating index_put)."""
from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from helpers.servers import run_bounded
from invariant_infer import NonInvariantOpError, audit, is_invariant, make_invariant, restore
from invariant_infer.checkpoints.loading import quantized_loading
from invariant_infer.checkpoints.quantized import packed_zero_points
from invariant_infer.model import audit as audit_module
from invariant_infer.model.audit import ALLOWED_OP_CLASSES, op_class, probe_inputs
from invariant_infer.model.families import FAMILIES
from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint, save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config, random_model, save_random_checkpoint

# One cell per kind in the fast tier: dense, MoE with a shared expert, hybrid (Gated DeltaNet), sinks and windows.
FAST_FAMILY_CELLS = ["qwen2-bfloat16", "qwen2_moe-float32", "qwen3_5_text-float16", "gpt_oss-bfloat16"]
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


def load(path, family: str, dtype):
    auto_class = AutoModelForImageTextToText if FAMILIES[family].vision is not None else AutoModelForCausalLM
    return auto_class.from_pretrained(path, dtype=dtype).eval()


def assert_stock_reported_and_patched_clean(model, **inputs):
    stock = audit(model, **inputs)
    assert not stock.ok and {op for _, op in stock.stray} & MATMULS, str(stock)
    make_invariant(model, strict=True)  # audits the probe forward, raises on a stray op
    assert is_invariant(model)
    patched = audit(model, **inputs)
    assert patched.ok, str(patched)
    return stock


# Every family in bf16 and in one other dtype, fp16 or fp32 by the parity of the name's length, so that
# adding a family moves no other family's cell (the dtype changes casts, not which ops run).
FAMILY_CELLS = [pytest.param(family, dtype, id=f"{family}-{str(dtype).removeprefix('torch.')}")
                for family in sorted(FAMILIES)
                for dtype in (torch.bfloat16, (torch.float16, torch.float32)[len(family) % 2])]


@pytest.mark.fast_cells(ids=FAST_FAMILY_CELLS)
@pytest.mark.parametrize("family, dtype", FAMILY_CELLS)
def test_every_family_audits_clean_and_its_stock_forward_does_not(family_checkpoints, family, dtype):
    assert_stock_reported_and_patched_clean(load(family_checkpoints(family), family, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "qwen3_5_text", "gpt_oss"])
def test_every_kind_audits_clean_on_cuda(family_checkpoints, family):
    """Compiled kernels: the launches on CUDA are inside the kernels as the interpreted ones are."""
    assert_stock_reported_and_patched_clean(load(family_checkpoints(family), family, torch.bfloat16).cuda())


@pytest.mark.heavy
@pytest.mark.parametrize("family, windows", [("mistral", dict(sliding_window=4)),
                                             ("qwen2", dict(use_sliding_window=True, sliding_window=4,
                                                            max_window_layers=1))], ids=["mistral", "qwen2"])
def test_windowed_layers_audit_clean(family, windows):
    model = random_model(random_config(family, "tiny", **windows), dtype=torch.bfloat16)
    inputs = probe_inputs(model)  # rows of 6 tokens: past the window of 4
    assert_stock_reported_and_patched_clean(model, **inputs)


def image_inputs(family: str) -> dict:
    """One row with an image of 4 x 4 patches (4 merged tokens) and a left-padded text-only row."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = random_config(family, "tiny")
    patch = config.vision_config.patch_size
    processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=(2 * patch) ** 2,
                                         max_pixels=(2 * patch) ** 2 * 64)
    image = np.random.default_rng(0).integers(0, 256, (4 * patch, 4 * patch, 3), dtype=np.uint8)
    pixels = processor(images=[image], return_tensors="pt")
    start, image_token, end = config.vision_start_token_id, config.image_token_id, config.vision_end_token_id
    row = [5, 6, start, *[image_token] * 4, end, 7]
    ids = torch.tensor([row, [0, 0, 0, 11, 12, 13, 14, 15, 16]])
    mask = (torch.arange(len(row)) >= torch.tensor([[0], [3]])).long()
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == image_token).to(torch.int32))


@pytest.mark.parametrize("family", [pytest.param("qwen2_5_vl", marks=pytest.mark.heavy), "qwen3_vl"])
def test_vision_language_forward_with_an_image_audits_clean(family_checkpoints, family):
    stock = assert_stock_reported_and_patched_clean(load(family_checkpoints(family), family, torch.bfloat16),
                                                    **image_inputs(family))
    assert any(module.startswith("model.visual") for module, _ in stock.stray)  # the tower ran and was audited


QUANTIZED_CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                        num_hidden_layers=1)
QUANTIZED_SCHEMES = ["FP8_BLOCK", "FP8_DYNAMIC", "FP8", "W8A8", "W4A16", "W4A16_ASYM", "transformers-fp8"]


@pytest.mark.parametrize("scheme", [s if s == "FP8_BLOCK" else pytest.param(s, marks=pytest.mark.heavy)
                                    for s in QUANTIZED_SCHEMES])
def test_quantized_checkpoints_audit_clean(tmp_path, scheme):
    config = qwen2_config("tiny", **QUANTIZED_CONFIG)
    if scheme == "transformers-fp8":
        path, loading = save_fp8_checkpoint(tmp_path, config), quantized_loading
    else:
        path, loading = save_quantized_checkpoint(tmp_path, config, scheme), packed_zero_points

    def load_quantized():
        with loading():
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    # A stock forward decompresses compressed-tensors' weights for good: the stock audit gets its own copy.
    # (transformers' stock fp8 forward fetches a hub kernel on CPU: its stock control is the others'.)
    if scheme != "transformers-fp8":
        stock = audit(load_quantized())
        assert not stock.ok and {op for _, op in stock.stray} & MATMULS, str(stock)
    model = make_invariant(load_quantized(), strict=True)
    assert is_invariant(model) and audit(model).ok


def test_peft_lora_audits_clean():
    from peft import LoraConfig, get_peft_model

    base = random_model(qwen2_config("tiny", num_hidden_layers=1), dtype=torch.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                        init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    stock = assert_stock_reported_and_patched_clean(model)
    assert any(".lora_A." in module for module, _ in stock.stray)  # named as the PeftModel names them


@pytest.mark.heavy
def test_tensor_parallel_audits_clean(tmp_path):
    """Two ranks under torchrun: dense, hybrid and Gemma 3 (windows, a scaled embedding) audit clean
    patched and pass strict; stock transformers TP reports its all-reduce."""
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    families = ["qwen2", "qwen3_5_text", "gemma3_text"]
    models = [arg for f in families for arg in
              ("--model", f"{f}={save_random_checkpoint(tmp_path / f, random_config(f, 'tiny', **shape), seed=3)}")]
    out = tmp_path / "out"
    out.mkdir()
    worker = Path(__file__).resolve().parents[1] / "helpers" / "tp_audit_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", "2", str(worker), "--out", str(out), *models]
    run = run_bounded(command, 300, {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    for family in families:
        assert (out / f"{family}-invariant.txt").read_text().startswith("audit ok"), family
        assert (out / f"{family}-strict.txt").read_text() == "strict ok", family
    assert re.search(r"all_?reduce", (out / "qwen2-stock.txt").read_text())  # c10d's name, or the functional one


# ---- hooks, attribution and strict ---------------------------------------------------------------

@pytest.fixture
def tiny_model():
    return random_model(qwen2_config("tiny"), dtype=torch.bfloat16)


def test_forward_hook_mm_is_reported_with_its_module_and_refused_by_strict(tiny_model):
    weight = torch.randn(64, 64, dtype=torch.bfloat16)

    def add_a_matmul(module, args, output):
        return output + torch.mm(output.reshape(-1, 64), weight).reshape(output.shape)

    hook = tiny_model.model.layers[0].mlp.register_forward_hook(add_a_matmul)
    make_invariant(tiny_model)
    report = audit(tiny_model)
    assert report.stray == [("model.layers.0.mlp", "aten.mm.default")]
    assert "aten.mm.default in model.layers.0.mlp" in str(report) and "FAILED" in str(report)
    with pytest.raises(NonInvariantOpError, match=r"aten\.mm\.default in model\.layers\.0\.mlp") as refused:
        make_invariant(tiny_model, strict=True)
    assert refused.value.stray == [("model.layers.0.mlp", "aten.mm.default")]
    assert is_invariant(tiny_model) and "stays as patched before" in str(refused.value)  # the caller's patch
    restore(tiny_model)
    with pytest.raises(NonInvariantOpError, match="The model was restored"):
        make_invariant(tiny_model, strict=True)
    assert not is_invariant(tiny_model)  # strict's own patch is undone
    hook.remove()
    assert is_invariant(make_invariant(tiny_model, strict=True))


def test_pre_hook_float_sum_is_reported_and_integer_sum_is_not(tiny_model):
    def float_sum(module, args):
        return (args[0] + 0 * args[0].sum(-1, keepdim=True),)

    def integer_sum(module, args, kwargs):
        kwargs["input_ids"].sum()
        kwargs["attention_mask"].cumsum(-1)

    tiny_model.model.layers[1].post_attention_layernorm.register_forward_pre_hook(float_sum)
    tiny_model.model.register_forward_pre_hook(integer_sum, with_kwargs=True)
    report = audit(make_invariant(tiny_model))
    assert report.stray == [("model.layers.1.post_attention_layernorm", "aten.sum.dim_IntList")]


def test_audit_leaves_outputs_and_state_untouched(tiny_model):
    model = make_invariant(tiny_model)
    inputs = {k: v for k, v in probe_inputs(model).items() if k != "use_cache"}
    with torch.no_grad():
        before = model(**inputs).logits
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    assert audit(model).ok and audit(model, **inputs).ok
    with torch.no_grad():
        after = model(**inputs).logits
    assert torch.equal(before, after)
    assert all(torch.equal(state[name], value) for name, value in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and not model.training and is_invariant(model)


# ---- the allowance table ---------------------------------------------------------------------------

class Calls(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


STRAY_CALLS = {
    "float sum": (lambda x: x.sum(-1), "aten.sum.dim_IntList"),
    "float mean": (lambda x: x.float().mean(), "aten.mean.default"),
    "softmax over three values": (lambda x: torch.softmax(x, -1), "aten._softmax.default"),
    "add with alpha 2": (lambda x: torch.add(x, x, alpha=2), "aten.add.Tensor"),
    "sigmoid": (lambda x: torch.sigmoid(x), "aten.sigmoid.default"),
    "accumulating index_put": (lambda x: torch.zeros(4).index_put_((torch.tensor([0, 0, 1]),), x[0], accumulate=True),
                               "aten.index_put_.default"),
    "matmul": (lambda x: x @ x.T, "aten.mm.default"),
    "layer norm": (lambda x: torch.nn.functional.layer_norm(x, (3,)), "aten.native_layer_norm.default"),
}


@pytest.mark.parametrize("fn, stray", STRAY_CALLS.values(), ids=STRAY_CALLS.keys())
def test_float_reductions_and_inexact_ops_outside_a_kernel_are_stray(fn, stray):
    report = audit(Calls(fn), x=torch.randn(3, 3))
    assert report.stray == [("", stray)], str(report)


EXACT_CALLS = {
    "integer sum and cumsum": lambda x: x.long().sum(-1).cumsum(0),
    "softmax over two values": lambda x: torch.softmax(x[:, :2], -1),
    "selection": lambda x: x.amax(-1) + x.topk(2).values[:, 0] * x.argmax(-1),
    "data movement": lambda x: x.reshape(9)[torch.tensor([1, 2])].clone().to(torch.float16),
    "correctly rounded elementwise": lambda x: (x * 2 - x / 3).clamp(0, 1).sqrt() + torch.add(x, x, alpha=1),
}


@pytest.mark.parametrize("fn", EXACT_CALLS.values(), ids=EXACT_CALLS.keys())
def test_exact_ops_are_allowed(fn):
    report = audit(Calls(fn), x=torch.randn(3, 3))
    assert report.ok and report.stray == [], str(report)


def test_every_allowance_class_has_its_reason():
    x = torch.randn(3, 3)
    seen = {op_class(torch.ops.aten.sum.dim_IntList, (x.long(), [0]), {}, x.long().sum(0)),
            op_class(torch.ops.aten.add.Tensor, (x, x), {}, x + x),
            op_class(torch.ops.aten._softmax.default, (x[:, :2], -1, False), {}, x[:, :2]),
            op_class(torch.ops.aten.amax.default, (x, [0]), {}, x.amax(0)),
            op_class(torch.ops.aten.clone.default, (x,), {}, x),
            op_class(torch.ops.aten.sym_size.int, (x, 0), {}, 3),
            op_class(torch.ops._c10d_functional.wait_tensor.default, (x,), {}, x)}
    assert seen == set(ALLOWED_OP_CLASSES) and all(ALLOWED_OP_CLASSES.values())


def kernel_file_function(source: str, name: str):
    """A function whose code lives in a (new) file of invariant_infer/kernels/, as a launcher's does."""
    namespace: dict = {}
    exec(compile(source, os.path.join(audit_module._KERNELS_DIR, "a_launcher.py"), "exec"), namespace)
    return namespace[name]


def test_ops_issued_from_the_kernels_files_are_not_stray():
    """The launchers' own torch-side work (any op, a float sum included) counts as inside the kernel."""
    launcher = kernel_file_function("def launcher(x):\n    return x.sum(-1)\n", "launcher")
    report = audit(Calls(launcher), x=torch.randn(3, 3))
    assert report.ok and report.ops_in_kernels == 1
    assert not audit(Calls(lambda x: x.sum(-1)), x=torch.randn(3, 3)).ok  # the same op from elsewhere


def test_code_a_kernel_calls_back_is_judged_by_its_own_frames():
    """A callable handed to a kernel entry point (as quantized_linear_autograd takes the layer's forward)
    is not inside the kernel: its float sum is stray."""
    calls_back = kernel_file_function("def calls_back(x, forward):\n    return forward(x)\n", "calls_back")
    report = audit(Calls(lambda x: calls_back(x, lambda y: y.sum(-1))), x=torch.randn(3, 3))
    assert report.stray == [("", "aten.sum.dim_IntList")]
