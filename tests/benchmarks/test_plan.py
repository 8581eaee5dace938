"""The plan report (``python -m benchmarks plan``): it runs for a family, its grids are the launches'
own (recorded, not run), and its roofline arithmetic on hand-checked cases."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import plan  # noqa: E402
from benchmarks.plan_costs import Cost, attention_decode_cost, gemm_cost  # noqa: E402
from invariant_infer.kernels import attention, linear  # noqa: E402
from invariant_infer.kernels.configs import TileTarget  # noqa: E402
from invariant_infer.kernels.launch_recording import recorded_launches  # noqa: E402


def test_report_runs_for_one_family_and_lists_each_kernel(capsys, tmp_path):
    """Every kernel row at each M and the decode rows, programs from recorded grids; --write-doc
    replaces only the marked section."""
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{plan.BEGIN}\nold\n{plan.END}\nafter\n")
    original, plan.DOC = plan.DOC, doc
    try:
        assert plan.main(["--families", "qwen2.5-1.5b", "--gpu", "h100", "--m", "1,16", "--write-doc"]) == 0
    finally:
        plan.DOC = original
    out = capsys.readouterr().out
    for kernel in ("q_proj 1536x1536", "k_proj 256x1536", "o_proj 1536x1536", "gate_proj 8960x1536",
                   "down_proj (silu_mul_linear) 1536x8960", "lm_head 151936x1536", "input_layernorm 1536",
                   "attention prefill 12/2x128", "| attention decode | B=1 L=8192", "paged attention decode"):
        assert kernel in out, kernel
    assert "below one wave" in out
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith(f"{plan.END}\nafter\n") and "old" not in text
    assert "**qwen2.5-1.5b**" in text and "| M=1 | M=16 | B=1 L=8192 | B=16 L=8192 |" in text


def _one_launch(call):
    with recorded_launches(TileTarget("cuda", 132), zeroed_allocations=False) as recorder, torch.no_grad():
        call()
    return recorder.launches


def test_recorded_grid_is_the_launch_formula_of_linear_and_attention():
    """Linear: (M tiles x N tiles, K chunks when they run in parallel, else 1) from the recorded
    tiles; attention prefill: (query blocks, batch x query heads) from its recorded BLOCK_M."""
    m, n, k = 300, 1024, 4096
    launches = _one_launch(lambda: linear(torch.empty(m, k, dtype=torch.bfloat16),
                                          torch.empty(n, k, dtype=torch.bfloat16)))
    first = launches[0]
    assert first.variant.name == "_linear_kernel"
    c = plan._constexprs(first)
    chunks = c["K_CHUNKS"] if c["PARALLEL_CHUNKS"] else 1
    assert first.grid == (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]), chunks, 1)
    assert first.programs == first.grid[0] * first.grid[1]

    b, hq, hkv, lq, d = 2, 8, 2, 200, 128
    q = torch.empty(b, hq, lq, d, dtype=torch.bfloat16)
    kv = torch.empty(b, hkv, lq, d, dtype=torch.bfloat16)
    bounds = (torch.zeros(b, dtype=torch.int32), torch.full((b,), lq, dtype=torch.int32),
              torch.zeros(b, dtype=torch.int32))
    (prefill,) = [launch for launch in _one_launch(lambda: attention(q, kv, kv, *bounds, d ** -0.5))
                  if launch.variant.name == "_attention_kernel"]
    assert prefill.grid[:2] == (triton.cdiv(lq, plan._constexprs(prefill)["BLOCK_M"]), b * hq)


def test_roofline_arithmetic_on_hand_checked_cases():
    h100 = plan.GPUS["h100"]
    # Qwen2.5-1.5B's q_proj at M = 1: 2 * (1536 + 1536^2 + 1536) bytes = 4,724,736; bandwidth-bound
    cost = gemm_cost(1, 1536, 1536)
    assert (cost.bytes, cost.flops) == (4_724_736, 4_718_592)
    assert plan.roofline_us(cost, h100) == pytest.approx(4_724_736 / 3.35e12 * 1e6)  # 1.41 us
    # a square 4096 GEMM: 2 * 4096^3 FLOPs = 137.4 GFLOP over 989 TFLOP/s = 139 us, compute-bound
    assert plan.roofline_us(gemm_cost(4096, 4096, 4096), h100) == pytest.approx(2 * 4096 ** 3 / 989e12 * 1e6)
    # decode, batch 1, 8192 keys, 8 KV heads of 128: K and V read once, 33.6 MB over 4.8 TB/s
    decode = attention_decode_cost(1, 8192, 32, 8, 128)
    assert decode.bytes == 2 * (2 * 8192 * 8 * 128 + 2 * 32 * 128)
    assert plan.roofline_us(decode, plan.GPUS["h200"]) == pytest.approx(decode.bytes / 4.8e12 * 1e6)
    assert plan.roofline_us(Cost(0, 0), h100) == 0
