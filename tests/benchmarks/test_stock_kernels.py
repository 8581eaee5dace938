"""The comparisons against the fastest stock kernels, without a GPU: a stock library that is missing
or raises skips its rows with the reason and fails nothing; stand-ins with the real libraries' call
signatures check that each baseline reads the same keys as the invariant kernels; the paged rows'
bitwise column fails on a paged kernel with another KV block; the FP8 rows quantize as
compressed-tensors does where it is missing; and the headline items are a part of the full grid."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import attention_vs_stock, matmul, quant, stock_kernels  # noqa: E402
from benchmarks.schema import REQUIRED  # noqa: E402
from benchmarks.stock_ratio_rows import ratio_rows, summary_lines  # noqa: E402
from benchmarks.timing import Run  # noqa: E402
from invariant_infer.kernels import AttentionConfig, paged_attention  # noqa: E402

HEADS = (2, 1, 16)  # query heads, KV heads, head_dim: the interpreter's cheapest GQA


def _ctx(section: str, items: str = "all") -> Run:
    ctx = Run(device=torch.device("cpu"), quick=True, items=items)
    ctx.section = section
    return ctx


@pytest.fixture
def tiny_items(monkeypatch):
    """One prefill of 1 x 8 and one decode of 2 sequences past two 64-key blocks."""
    monkeypatch.setattr(attention_vs_stock, "QUICK_PREFILL", [(1, 8)])
    monkeypatch.setattr(attention_vs_stock, "QUICK_DECODE", [(2, 70)])


def _attention_rows(ctx: Run) -> list[dict]:
    return attention_vs_stock.run(ctx, torch.Generator().manual_seed(0), torch.float32, HEADS)


def _sdpa(q, k, v, causal):  # [B, L, H, D] in and out, as FlashAttention takes them
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         enable_gqa=True)
    return out.transpose(1, 2)


class FakeDecodeWrapper:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper (plan / run, NHD pages) in torch."""

    def __init__(self, workspace, layout):
        assert layout == "NHD"

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, q_data_type=None, kv_data_type=None):
        self.pages = [indices[indptr[s]:indptr[s + 1]].long() for s in range(len(indptr) - 1)]
        self.lens = [(len(p) - 1) * page_size + int(n) for p, n in zip(self.pages, last_page_len)]

    def run(self, q, kv):
        outs = []
        for s, (pages, length) in enumerate(zip(self.pages, self.lens)):
            k, v = (cache[pages].flatten(0, 1)[:length][None] for cache in kv)  # [1, L, Hkv, D]
            outs.append(_sdpa(q[s][None, None], k, v, causal=False)[0, 0])
        return torch.stack(outs)


def _fake_libraries(monkeypatch, broken: bool = False):
    def flash_attn_func(q, k, v, causal):
        if broken:
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")
        return _sdpa(q, k, v, causal)

    def flash_attn_with_kvcache(q, k, v, cache_seqlens, causal):
        return torch.cat([_sdpa(q[s:s + 1], k[s:s + 1, :n], v[s:s + 1, :n], causal=False)
                          for s, n in enumerate(cache_seqlens.tolist())])
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_func=flash_attn_func, flash_attn_with_kvcache=flash_attn_with_kvcache))
    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecodeWrapper))


def test_missing_stock_libraries_skip_their_rows_only(tiny_items, monkeypatch):
    monkeypatch.setattr(stock_kernels, "importable", lambda module: (None, f"{module} not importable"))
    ctx = _ctx("norm_attention")
    rows = _attention_rows(ctx)
    assert ctx.skipped == [] and all(set(REQUIRED["attention_vs_stock"]) <= set(r) for r in rows)
    got = [(r["case"], r["invariant"], r["stock"], r["skipped"]) for r in rows]
    assert got == [("prefill", "attention", "sdpa_flash", None),
                   ("prefill", "attention", "flash_attn_func", "flash_attn not importable")] + [
        ("decode", kernel, stock, why) for kernel in ("attention", "paged_attention")
        for stock, why in (("flashinfer_decode", "flashinfer not importable"),
                           ("flash_attn_with_kvcache", "flash_attn not importable"), ("sdpa", None))]
    for row in rows:
        assert (row["ratio"] is None) is (row["skipped"] is not None) and row["device"] == "cpu"
        assert row["bitwise_equal_to_attention"] is (True if row["invariant"] == "paged_attention" else None)
        assert row["skipped"] is not None or row["max_abs_diff"] < 1e-5
    assert summary_lines({"attention_vs_stock": rows})[-3:] == [
        "attention vs flash_attn_func: skipped (flash_attn not importable)",
        "attention vs flashinfer_decode: skipped (flashinfer not importable)",
        "attention vs flash_attn_with_kvcache: skipped (flash_attn not importable)"]
    table = ratio_rows("ratios_attention", {"attention_vs_stock": rows})
    assert table[1][2] == "flash_attn not importable" and table[-1][5] == "paged = attention: yes"


def test_stock_decode_kernels_read_the_same_keys(tiny_items, monkeypatch):
    """Stand-ins with FlashInfer's and FlashAttention's signatures, computed in torch: each baseline
    gets the invariant kernels' keys (pages, lengths, layouts), so its output is theirs to fp32 rounding."""
    _fake_libraries(monkeypatch)
    ctx = _ctx("norm_attention")
    rows = _attention_rows(ctx)
    assert ctx.skipped == [] and all(r["skipped"] is None for r in rows) and len(rows) == 2 + 2 * 3
    assert all(r["max_abs_diff"] < 1e-5 and r["ratio"] > 0 for r in rows)


def test_a_stock_kernel_that_raises_skips_its_rows(tiny_items, monkeypatch):
    _fake_libraries(monkeypatch, broken=True)
    ctx = _ctx("norm_attention")
    rows = {(r["case"], r["invariant"], r["stock"]): r for r in _attention_rows(ctx)}
    assert ctx.skipped == []
    assert rows["prefill", "attention", "flash_attn_func"]["skipped"] == (
        "flash_attn_func raised RuntimeError: FlashAttention only supports Ampere GPUs or newer")


def test_paged_rows_catch_a_paged_kernel_with_another_kv_block(tiny_items, monkeypatch):
    """Control of ``bitwise_equal_to_attention``: a paged kernel walking 32-key blocks (the attention
    kernel walks 64) reduces each row in another order."""
    monkeypatch.setattr(attention_vs_stock, "paged_attention",
                        lambda *args, **kwargs: paged_attention(*args, config=AttentionConfig(32, 32), **kwargs))
    monkeypatch.setattr(attention_vs_stock, "QUICK_PREFILL", [])
    rows = _attention_rows(_ctx("norm_attention"))
    assert {r["bitwise_equal_to_attention"] for r in rows if r["invariant"] == "paged_attention"} == {False}


def test_importable_names_what_is_missing_or_broken(tmp_path, monkeypatch):
    assert stock_kernels.importable("a_module_no_machine_has") == (None, "a_module_no_machine_has not importable")
    (tmp_path / "broken_stock_library.py").write_text("raise OSError('libcudart.so.12: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module, why = stock_kernels.importable("broken_stock_library")
    assert module is None and why == "broken_stock_library not importable: OSError: libcudart.so.12: cannot open"


def test_scaled_mm_baseline_needs_compute_capability_8_9(monkeypatch):
    assert stock_kernels.fp8_scaled_mm_refusal(torch.device("cpu")) == \
        "torch._scaled_mm needs a CUDA GPU (running on cpu)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert stock_kernels.fp8_scaled_mm_refusal(torch.device("cuda")) == \
        "torch._scaled_mm needs compute capability 8.9 (found 8.0)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert stock_kernels.fp8_scaled_mm_refusal(torch.device("cuda")) is None


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
def test_fp8_weights_quantized_in_torch_are_compressed_tensors_bits(fmt):
    pytest.importorskip("compressed_tensors")
    w = (torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 384 ** -0.5).bfloat16()
    compressed, scheme, compressor = quant.compressed_weight(w, quant.FORMATS[fmt])
    theirs, ours = quant.invariant_weight(compressed, fmt, (256, 384)), quant.torch_fp8_weight(w, fmt)
    assert torch.equal(ours.scale, theirs.scale) and torch.equal(ours.data.view(torch.uint8),
                                                                 theirs.data.view(torch.uint8))
    assert torch.equal(quant.torch_dequantized(ours), compressor.decompress(compressed, scheme)["weight"])


def test_quant_rows_without_compressed_tensors(monkeypatch):
    """Where compressed-tensors is missing (the GPU image) the fp8 rows run on weights quantized in
    torch, the int4 rows are skipped with the reason, and no item fails."""
    monkeypatch.setattr(quant, "importable", lambda module: (None, f"{module} not importable"))
    monkeypatch.setattr(quant, "QUICK_SHAPES", {"tiny": {"gate/up": (256, 128)}})
    ctx = _ctx("quant")
    rows = quant.run(ctx, ms=(1, 3))["quant"]
    assert ctx.skipped == [] and all(set(REQUIRED["quant"]) <= set(r) for r in rows)
    assert [(r["format"], r["M"], r["stock"], r["skipped"]) for r in rows] == [
        ("fp8_block", 1, quant.TORCH_DEQUANTIZE, None), ("fp8_block", 3, quant.TORCH_DEQUANTIZE, None),
        ("fp8_channel", 1, quant.TORCH_DEQUANTIZE, None), ("fp8_channel", 3, quant.TORCH_DEQUANTIZE, None),
        ("int4_w4a16", 1, None, "compressed_tensors not importable"),
        ("int4_w4a16", 3, None, "compressed_tensors not importable")]
    assert all(r["invariant_alone_bitwise_equal"] for r in rows[:4])
    assert rows[0]["stock_skipped"] == "torch._scaled_mm needs a CUDA GPU (running on cpu)"


def test_fp8_stock_falls_back_in_order_and_says_why():
    """torch._scaled_mm as is, then on padded rows, then the dequantized GEMM: the first that runs
    at this M is the row's stock, and the reason the preferred one did not run is kept."""
    def refuses(x):
        raise RuntimeError("mat1 dimensions must be divisible by 16")
    x = torch.randn(3, 32)
    fallback = {quant.TORCH_DEQUANTIZE: lambda t: t * 2}
    stocks = {quant.SCALED_MM: refuses, quant.SCALED_MM_PADDED: lambda t: refuses(quant._rows_padded(t))[:3],
              **fallback}
    name, _, y, why = quant._first_that_runs(stocks, x)
    assert (name, why) == (quant.TORCH_DEQUANTIZE, f"{quant.SCALED_MM} raised RuntimeError: mat1 dimensions must be "
                                                   "divisible by 16") and torch.equal(y, x * 2)
    stocks[quant.SCALED_MM_PADDED] = lambda t: quant._rows_padded(t)[:3] + 1
    name, _, y, why = quant._first_that_runs(stocks, x)
    assert (name, why) == (quant.SCALED_MM_PADDED, None) and torch.equal(y, x + 1)
    assert quant._rows_padded(x).shape == (16, 32) and quant._rows_padded(torch.randn(32, 4)).shape == (32, 4)


@pytest.mark.parametrize("quick", [False, True])
def test_headline_items_are_the_grids_fp8_gemms_and_the_rest_the_others(quick):
    def items(which):
        ctx = Run(device=torch.device("cpu"), quick=quick, items=which)
        return quant.items(ctx, "qwen2", "qwen2.5-1.5b")
    head, rest, every = items("headline"), items("rest"), items("all")
    assert sorted(head + rest) == sorted(every) and not set(head) & set(rest)
    shapes = quant.QUICK_HEADLINE_SHAPES if quick else quant.HEADLINE_SHAPES
    ms = quant.QUICK_HEADLINE_MS if quick else quant.HEADLINE_MS
    preset = next(iter(quant.shape_sets(Run(torch.device("cpu"), quick), "qwen2", "qwen2.5-1.5b")))
    assert sorted(head) == sorted((preset, name, fmt, m) for name in shapes for fmt in quant.HEADLINE_FORMATS
                                  for m in ms)
    gemm = Run(device=torch.device("cpu"), quick=False, items="headline")
    assert gemm.grid(matmul.MS, matmul.QUICK_MS, matmul.HEADLINE_MS) == [1, 16, 64, 4096]
    assert set(matmul.HEADLINE_MS) <= set(matmul.MS)
