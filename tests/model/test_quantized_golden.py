"""The quantized formats' golden digests (``benchmarks.golden_digests.quantized_digests``, checked with the others by
``test_golden_digests.py``): a batch-variant activation scale moves them, and the check names them."""
import compressed_tensors  # noqa: F401  (the test extra pins it: a missing install fails, never skips)
import pytest
import torch

import invariant_infer.model.quantization as quantization
from benchmarks import golden_digests as golden


def _per_tensor(x2, dtype, group=None):
    """One fp8 scale for the whole batch (the max over every token): rows depend on their neighbours."""
    scale = (x2.float().abs().amax() / 448).clamp(min=1e-12)
    q = (x2.float() / scale).clamp(-448, 448).to(dtype)
    return q, scale.reshape(1, 1).expand(x2.shape[0], 1 if group is None else x2.shape[1] // group).contiguous()


@pytest.mark.heavy
def test_a_batch_variant_activation_scale_moves_the_quantized_digests(monkeypatch, tmp_path):
    recorded = golden.load()["cpu-interpreter"]
    mine = {k: v for k, v in recorded["digests"].items() if k.startswith("quant/FP8_DYNAMIC/")}
    assert golden.quantized_digests("cpu", tmp_path / "as-is", formats=["FP8_DYNAMIC"]) == mine
    monkeypatch.setattr(quantization, "quantize_activations", _per_tensor)
    current = golden.quantized_digests("cpu", tmp_path / "per-tensor", formats=["FP8_DYNAMIC"])
    problem = golden.explain("cpu-interpreter", {**recorded, "digests": mine}, current, golden.environment("cpu"))
    assert problem is not None and "moved:   quant/FP8_DYNAMIC/bf16/left_pad" in problem


@pytest.mark.heavy
def test_a_batch_variant_activation_scale_in_the_experts_moves_the_fp8_moe_digests(monkeypatch, tmp_path):
    """The fp8 MoE model's experts alone take the per-tensor scale (over every routed row)."""
    import invariant_infer.model.quantized_experts as quantized_experts

    recorded = golden.load()["cpu-interpreter"]
    mine = {k: v for k, v in recorded["digests"].items() if k.startswith("quant/fp8-moe/")}
    assert len(mine) == 4 and golden.quantized_digests("cpu", tmp_path / "as-is", formats=["fp8-moe"]) == mine
    monkeypatch.setattr(quantized_experts, "quantize_activations", _per_tensor)
    current = golden.quantized_digests("cpu", tmp_path / "per-tensor", formats=["fp8-moe"])
    problem = golden.explain("cpu-interpreter", {**recorded, "digests": mine}, current, golden.environment("cpu"))
    assert problem is not None and "moved:   quant/fp8-moe/bf16/left_pad" in problem
