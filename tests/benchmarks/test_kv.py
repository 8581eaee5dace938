"""The KV memory report (``python -m benchmarks kv``): its accounting against a hand computation on a
tiny config, the real presets' ratios (windows help Gemma 3, gpt-oss and windowed Mistral; a Mistral
without a window gains nothing), and ``--write-doc`` replacing only its marked section."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import kv  # noqa: E402
from benchmarks.__main__ import main as benchmarks_main  # noqa: E402
from invariant_infer.model.cache_specs import cache_specs  # noqa: E402
from invariant_infer.testing.random_checkpoints import random_config  # noqa: E402


def test_tiny_config_against_hand_computation():
    """Gemma 3 tiny: a sliding layer (window 24) and a full one, 1 KV head of 32: 2 * 32 * 2 = 128 bytes a
    token in bf16. 100 tokens in pages of 16: 7 pages each before; after, the sliding layer holds
    ceil(24 / 16) + 1 = 3."""
    specs = cache_specs(random_config("gemma3_text"))
    assert kv.request_cache_bytes(specs, 100, torch.bfloat16, 16, windows=False) == 2 * 7 * 16 * 128
    assert kv.request_cache_bytes(specs, 100, torch.bfloat16, 16) == (7 + 3) * 16 * 128
    assert kv.request_cache_bytes(specs, 20, torch.bfloat16, 16) == (2 + 2) * 16 * 128  # within the window
    # Qwen3.5 tiny: its linear layer's state (conv_dim 2 * 2 * 16 + 4 * 32 = 192: 63 rows of 192 + 8, 3
    # convolution inputs of 192, the fp32 state 4 x 16 x 32) does not grow with the context; its full
    # layer (2 heads of 32) does.
    hybrid = cache_specs(random_config("qwen3_5_text"))
    state = 63 * (192 + 8) * 2 + 3 * 192 * 2 + 4 * 4 * 16 * 32
    for context in (10, 100):
        pages = -(-context // 16)
        assert kv.request_cache_bytes(hybrid, context, torch.bfloat16, 16) == state + pages * 16 * 2 * 2 * 32 * 2


def test_windows_shrink_gemma_gpt_oss_and_windowed_mistral_only(capsys):
    models = {**kv.MODELS, "mistral-7b-v0.3": ("mistral", "mistral-7b-v0.3")}
    rows = {(row.model, row.context): row for row in kv.kv_rows(models, (8192, 32768))}
    for name in kv.MODELS:
        for context in (8192, 32768):
            row = rows[(name, context)]
            assert row.page_size == 64 and row.ratio > 1 and row.requests_after > row.requests_before
    assert rows[("gemma-3-27b", 32768)].ratio > 5  # 62 layers, 10 of them full
    for context in (8192, 32768):  # negative control: no window, nothing freed
        row = rows[("mistral-7b-v0.3", context)]
        assert row.before == row.after and row.ratio == 1 and row.requests_before == row.requests_after
    assert rows[("mistral-7b-v0.3", 8192)].before == 32 * 8192 * 2 * 8 * 128 * 2


def test_cli_writes_only_its_doc_section(capsys, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{kv.BEGIN}\nold\n{kv.END}\nafter\n")
    original, kv.DOC = kv.DOC, doc
    try:
        assert benchmarks_main(["kv", "--models", "gpt-oss-20b", "--contexts", "8192", "--write-doc"]) == 0
    finally:
        kv.DOC = original
    out = capsys.readouterr().out
    # By hand: 2 * 8 heads * 64 * 2 bytes = 2 KiB a token a layer; 8192 tokens are 128 pages of 64: 16 MiB a
    # layer, 24 layers before; after, 12 full and 12 sliding of 3 pages (384 KiB). 40 GiB / 384 MiB = 106.7,
    # / 196.5 MiB = 208.4.
    assert "| gpt-oss-20b | 12 full + 12 sliding (w 128) | 8,192 | 64 | 384.0 | 196.5 | 1.95 | 106 | 208 |" in out
    text = doc.read_text()
    assert text.startswith(f"before\n{kv.BEGIN}\n") and text.endswith(f"{kv.END}\nafter\n") and "old" not in text
    assert out in text
