"""The fuzz command (python -m benchmarks.fuzz), in-process and small: it finds no mismatch on the
patched models, checks exactly the rows it drew, and catches a batch-variant linear."""
import json

import pytest

import invariant_infer.patch
from benchmarks import fuzz
from invariant_infer.families import FAMILIES

# Small draws so that CI stays fast: 4 samples of up to 12 tokens per family, batches of 1-4.
SMALL = ["--pool-size", "4", "--max-len", "12", "--long-len", "0", "--max-batch", "4", "--quiet"]


def expected_rows(batchings: int, families, dtypes, seed: int = 0) -> int:
    lengths = {f: fuzz.pool_lengths(seed, f, 4, 12, 0) for f in families}
    return sum(len(fuzz.draw(seed, i, families, dtypes, lengths, max_batch=4).members) for i in range(batchings))


def test_fuzz_finds_no_mismatch(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert fuzz.main(["--batchings", "20", "--out", str(out), *SMALL]) == 0
    summary = json.loads(out.read_text())
    families, dtypes = sorted(FAMILIES), list(fuzz.DTYPES)
    assert summary["batchings"] == 20 and summary["rows_unequal"] == 0 and summary["failures"] == []
    assert summary["rows"] == expected_rows(20, families, dtypes)
    assert sum(cell["batchings"] for cell in summary["per_model"].values()) == 20
    assert summary["alone_forwards"] <= len(families) * len(dtypes) * 4  # each sample alone once per model
    for key in ("side=left", "side=right", "input_ids", "inputs_embeds", "explicit_positions", "derived_positions"):
        assert summary["coverage"].get(key, 0) > 0, key
    for key in ("command", "torch", "transformers", "triton", "device", "elapsed_s"):
        assert summary[key] is not None
    assert "| **all** | 20 |" in capsys.readouterr().out


NARROW = ["--batchings", "4", "--families", "qwen2", "--dtypes", "fp32", *SMALL]


def test_negative_control_is_caught(tmp_path):
    """The same batchings, with a linear that picks BLOCK_K by M: rows differ, and that is the
    negative control's success (exit status 0)."""
    out = tmp_path / "neg.json"
    assert fuzz.main([*NARROW, "--negative-control", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["negative_control"] and summary["batchings"] == 4
    assert summary["rows_unequal"] > 0 and summary["max_abs_diff"] > 0
    assert invariant_infer.patch.linear is not fuzz.m_dependent_linear  # restored afterwards


def test_mismatch_fails_with_a_replay_command(tmp_path, monkeypatch, capsys):
    """Without --negative-control, a batch-variant path makes the command fail and print how to
    replay the failing batching."""
    monkeypatch.setattr(invariant_infer.patch, "linear", fuzz.m_dependent_linear)
    out = tmp_path / "fail.json"
    assert fuzz.main([*NARROW, "--out", str(out)]) == 1
    failure = json.loads(out.read_text())["failures"][0]
    assert failure["mismatches"] and "--replay" in failure["replay"] and "--seed 0" in failure["replay"]
    assert "MISMATCH" in capsys.readouterr().err


def test_draws_are_reproducible():
    families, dtypes = ["qwen2", "qwen3"], ["bf16", "fp32"]
    lengths = {f: fuzz.pool_lengths(7, f) for f in families}
    first = [fuzz.draw(7, i, families, dtypes, lengths) for i in range(50)]
    assert first == [fuzz.draw(7, i, families, dtypes, lengths) for i in range(50)]
    assert fuzz.draw(7, 3, families, dtypes, lengths) == first[3]  # an index alone: what --replay runs
    assert first != [fuzz.draw(8, i, families, dtypes, lengths) for i in range(50)]
    assert all(1 <= len(b.members) <= fuzz.MAX_BATCH and 0 <= b.extra_pad <= fuzz.MAX_EXTRA_PAD for b in first)
    assert all(lengths[f][:3] == [1, fuzz.MAX_LEN, fuzz.LONG_LEN] and len(lengths[f]) == fuzz.SAMPLES_PER_POOL
               for f in families)


def test_unknown_family_is_rejected():
    with pytest.raises(SystemExit):
        fuzz.parse(["--families", "gpt2"])
