"""The fuzz commands, small: ``benchmarks.fuzz`` finds no mismatch on the patched models, checks
exactly the rows it drew, catches a batch-variant linear, and gives the same summary in 2 worker
processes as in one; the worker pool stops every worker when one fails or its parent is stopped;
``benchmarks.fuzz_engine`` finds every request equal to the request alone and catches the
batch-variant linear too."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import invariant_infer.model.layer_forwards
import parallel_work
from invariant_infer.model import experts as hf_experts
from benchmarks import fuzz, fuzz_engine
from benchmarks.fuzz_parallel import WorkerFailed, outcomes
from invariant_infer.model.families import FAMILIES

pytestmark = pytest.mark.file_minutes(1.1)  # measured on 2 cores: start it early

# Small draws so that CI stays fast: 4 samples of up to 12 tokens per family, batches of 1-4.
SMALL = ["--pool-size", "4", "--max-len", "12", "--long-len", "0", "--max-batch", "4", "--quiet"]


def expected_rows(batchings: int, families, dtypes, seed: int = 0) -> int:
    lengths = {f: fuzz.pool_lengths(seed, f, 4, 12, 0) for f in families}
    return sum(len(fuzz.draw(seed, i, families, dtypes, lengths, max_batch=4).members) for i in range(batchings))


@pytest.mark.heavy
def test_fuzz_finds_no_mismatch(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert fuzz.main(["--batchings", "20", "--out", str(out), *SMALL]) == 0
    summary = json.loads(out.read_text())
    families, dtypes = fuzz.TEXT_FAMILIES, list(fuzz.DTYPES)
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


@pytest.mark.heavy
def test_negative_control_is_caught(tmp_path):
    """The same batchings, with a linear that picks BLOCK_K by M: rows differ, and that is the
    negative control's success (exit status 0)."""
    out = tmp_path / "neg.json"
    assert fuzz.main([*NARROW, "--negative-control", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["negative_control"] and summary["batchings"] == 4
    assert summary["rows_unequal"] > 0 and summary["max_abs_diff"] > 0
    assert invariant_infer.model.layer_forwards.linear is not fuzz.m_dependent_linear  # restored afterwards


MOE = ["--batchings", "2", "--families", "qwen3_moe", "--dtypes", "fp32", *SMALL]


@pytest.mark.heavy
def test_fuzz_covers_a_moe_family(tmp_path, monkeypatch):
    """qwen3_moe batchings (a sparse block, 8 experts, top-4): every row bitwise alone. The same batchings
    with only the experts' grouped GEMM keyed by its most crowded expert differ, so the fuzz sees batch
    dependence in the experts, not just in the dense projections."""
    out = tmp_path / "moe.json"
    assert fuzz.main([*MOE, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["rows"] == expected_rows(2, ["qwen3_moe"], ["fp32"]) > 2 and summary["rows_unequal"] == 0
    assert list(summary["per_model"]) == ["qwen3_moe/fp32"]
    assert summary["model_overrides"]["qwen3_moe"]["head_dim"] == 16
    monkeypatch.setattr(hf_experts, "grouped_linear", fuzz.m_dependent_grouped_linear)
    assert fuzz.main([*MOE, "--out", str(out)]) == 1  # a mismatch: exit status 1
    summary = json.loads(out.read_text())
    assert summary["rows_unequal"] > 0 and summary["max_abs_diff"] > 0


GEMMA4_MOE = ["--batchings", "2", "--families", "gemma4_text@tiny-moe", "--dtypes", "fp32", *SMALL]


@pytest.mark.heavy
def test_fuzz_covers_gemma4s_moe_variant(tmp_path, monkeypatch):
    """Gemma 4's MoE variant, a model of its own (the tiny-moe preset with gemma4_text's fuzz overrides: 8
    experts, top-2, beside the dense MLP of each of its 3 layers): every row bitwise alone; with the
    experts' grouped GEMM keyed by its most crowded expert, rows differ."""
    out = tmp_path / "gemma4-moe.json"
    assert fuzz.main([*GEMMA4_MOE, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["rows"] == expected_rows(2, ["gemma4_text@tiny-moe"], ["fp32"]) > 2
    assert summary["rows_unequal"] == 0 and list(summary["per_model"]) == ["gemma4_text@tiny-moe/fp32"]
    overrides = summary["model_overrides"]["gemma4_text@tiny-moe"]
    assert overrides["num_hidden_layers"] == 3 and overrides["num_kv_shared_layers"] == 1
    monkeypatch.setattr(hf_experts, "grouped_linear", fuzz.m_dependent_grouped_linear)
    assert fuzz.main([*GEMMA4_MOE, "--out", str(out)]) == 1
    assert json.loads(out.read_text())["rows_unequal"] > 0


def test_gemma4s_moe_variant_is_drawn_unquantized_by_both_fuzzes():
    from benchmarks.fuzz_draws import fuzz_config
    config = fuzz_config("gemma4_text@tiny-moe")
    assert config.enable_moe_block and (config.num_experts, config.top_k_experts) == (8, 2)
    assert config.num_hidden_layers == 3 and not fuzz_config("gemma4_text").enable_moe_block
    assert fuzz.TEXT_FAMILIES[-1] == fuzz_engine.ENGINE_FAMILIES[-1] == "gemma4_text@tiny-moe"
    models = fuzz.parse(["--formats", "none,W4A16,fp8"]).models
    assert "gemma4_text@tiny-moe" in models and not any(m.startswith("gemma4_text@tiny-moe:") for m in models)


def test_negative_control_patches_the_moe_experts_too():
    with fuzz.batch_variant_linear():
        assert invariant_infer.model.layer_forwards.linear is fuzz.m_dependent_linear is hf_experts.linear  # router too
        assert hf_experts.grouped_linear is fuzz.m_dependent_grouped_linear
    assert fuzz.m_dependent_linear not in (invariant_infer.model.layer_forwards.linear, hf_experts.linear)
    assert hf_experts.grouped_linear is not fuzz.m_dependent_grouped_linear


def test_mismatch_fails_with_a_replay_command(tmp_path, monkeypatch, capsys):
    """Without --negative-control, a batch-variant path makes the command fail and print how to
    replay the failing batching."""
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", fuzz.m_dependent_linear)
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


@pytest.mark.heavy
def test_two_workers_give_the_summary_of_one(tmp_path):
    """Split by index over 2 processes, the negative control's batchings (mismatches included, to
    the bit of each max |diff|) merge into exactly the one-process summary."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    args = ["--batchings", "6", "--families", "qwen2", "--dtypes", "fp32,fp16", "--negative-control", *SMALL]
    assert fuzz.main([*args, "--out", str(one)]) == 0
    assert fuzz.main([*args, "--out", str(two), "--workers", "2"]) == 0
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["failures"], "the negative control found no mismatch to compare"
    for key in ("batchings", "rows", "rows_unequal", "batchings_unequal", "max_abs_diff", "per_model", "coverage",
                "failures"):
        assert a[key] == b[key], key
    assert b["workers"] == 2 and b["worker_batchings"] == [3, 3] and b["finished"]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def _wait_gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.heavy
def test_workers_split_by_index_and_a_failed_worker_stops_all():
    items = sorted((item["index"], item["square"]) for _, item in outcomes(parallel_work.squares, None, range(7), 3))
    assert items == [(i, i * i) for i in range(7)]
    pids = set()
    with pytest.raises(WorkerFailed, match="index 3 is poison"):
        for _, item in outcomes(parallel_work.fails_at_3, None, range(100), 2):
            pids.add(item["pid"])
    assert len(pids) == 2 and _wait_gone(pids, timeout=1.0)  # stopped before outcomes returned


POOL_SCRIPT = """
import signal, parallel_work
from benchmarks.fuzz_parallel import outcomes
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if pytest's process ignores it
for _, item in outcomes(parallel_work.forever, None, range(4), 2):
    print(item["pid"], flush=True)
"""


@pytest.mark.heavy
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_stopping_the_parent_stops_every_worker(sig):
    """SIGTERM and Ctrl-C: the parent terminates its workers; SIGKILL: the orphans exit themselves."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    parent = subprocess.Popen([sys.executable, "-c", POOL_SCRIPT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(parent.stdout.readline()) for _ in range(2)]
        parent.send_signal(sig)
        assert parent.wait(timeout=20) != 0
        assert _wait_gone(pids), f"workers {pids} still running after {sig.name}"
    finally:
        parent.kill()
        parent.wait()


ENGINE_SMALL = ["--quiet"]


@pytest.mark.heavy
def test_engine_fuzz_finds_every_request_equal_alone(tmp_path):
    out = tmp_path / "engine.json"
    # Schedules 0 and 1 of seed 0 cover every feature below; schedule 2 runs in the negative control.
    assert fuzz_engine.main(["--schedules", "2", "--out", str(out), *ENGINE_SMALL]) == 0
    summary = json.loads(out.read_text())
    assert summary["schedules"] == 2 and summary["requests_unequal"] == 0 and summary["failures"] == []
    assert summary["requests"] == sum(len(s.requests) for s in _schedules(range(2)))
    for key in ("greedy", "sampled", "staggered_arrivals", "chunked_prefill", "prefix_hit"):
        assert summary["coverage"].get(key, 0) > 0, key


@pytest.mark.heavy
def test_engine_fuzz_catches_a_batch_variant_linear(tmp_path):
    out = tmp_path / "engine-neg.json"
    # Schedule 2 of seed 0 on qwen2 fp32: two prompts of 86 and 58 tokens with a shared prefix,
    # chunked by a 48-token budget (one schedule keeps the test short).
    narrow = ["--families", "qwen2", "--dtypes", "fp32", "--start", "2", "--schedules", "1", *ENGINE_SMALL]
    assert fuzz_engine.main([*narrow, "--negative-control", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["requests_unequal"] > 0 and "--replay" in summary["failures"][0]["replay"]
    assert invariant_infer.model.layer_forwards.linear is not fuzz.m_dependent_linear


def test_engine_fuzz_records_an_engine_that_raises_and_goes_on(tmp_path, monkeypatch, capsys):
    def stalls(self, schedule):
        raise RuntimeError(f"schedule {schedule.index}: no progress")
    monkeypatch.setattr(fuzz_engine.Runner, "together", stalls)
    out = tmp_path / "raises.json"
    assert fuzz_engine.main(["--schedules", "2", "--out", str(out), *ENGINE_SMALL]) == 1
    summary = json.loads(out.read_text())
    assert summary["schedules"] == 2 and [f["index"] for f in summary["failures"]] == [0, 1]
    assert summary["failures"][1]["mismatches"][0]["fields"] == ["raised RuntimeError: schedule 1: no progress"]
    assert "--replay 0" in capsys.readouterr().err


def _schedules(indices, seed: int = 0, families=fuzz_engine.ENGINE_FAMILIES, dtypes=list(fuzz.DTYPES)):
    vocab, pages = fuzz_engine.draw_context(families, dtypes, "cpu")
    return [fuzz_engine.draw(seed, i, families, dtypes, vocab, pages) for i in indices]


def test_engine_schedules_are_reproducible():
    first = _schedules(range(40))
    assert first == _schedules(range(40)) and _schedules([7]) == [first[7]]
    assert first != _schedules(range(40), seed=1)
    assert all(2 <= len(s.requests) <= fuzz_engine.MAX_REQUESTS and 1 <= s.max_num_seqs <= len(s.requests)
               for s in first)
    assert any(s.shared_prefix for s in first) and any(not s.shared_prefix for s in first)
    speculating = [s for s in first if s.speculative]
    assert {dict(s.speculative)["method"] for s in speculating} == {"ngram", "draft_model"} and len(speculating) < 40
    assert all(dict(s.speculative)["num_speculative_tokens"] < s.max_num_batched_tokens for s in speculating)


QUANT = ["--batchings", "3", "--families", "qwen2", "--formats", "FP8_BLOCK,W8A8,W4A16", *SMALL]


@pytest.mark.heavy
def test_fuzz_covers_the_quantized_formats(tmp_path, monkeypatch):
    """qwen2 in three checkpoint formats (models qwen2:FORMAT, bf16 and fp16): every row bitwise alone.
    The same batchings with a per-tensor dynamic activation scale (the max over the batch) differ."""
    import compressed_tensors  # noqa: F401  (the test extra pins it: a missing install fails)
    from benchmarks import fuzz_quantized
    from invariant_infer.model import quantization

    models = ["qwen2:FP8_BLOCK", "qwen2:W8A8", "qwen2:W4A16"]
    out = tmp_path / "quant.json"
    assert fuzz.main([*QUANT, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["models"] == models and summary["dtypes"] == ["bf16", "fp16"]
    assert summary["rows"] == expected_rows(3, models, ["bf16", "fp16"]) > 3 and summary["rows_unequal"] == 0
    assert summary["model_overrides"]["qwen2:W8A8"]["hidden_size"] == 128
    drawn = {key.split("/")[0] for key, cell in summary["per_model"].items() if cell["batchings"]}
    assert drawn & {"qwen2:FP8_BLOCK", "qwen2:W8A8"}  # an activation-quantized format ran
    monkeypatch.setattr(quantization, "quantize_activations", fuzz_quantized.per_tensor_activations)
    assert fuzz.main([*QUANT, "--out", str(out)]) == 1  # a mismatch: exit status 1
    summary = json.loads(out.read_text())
    assert summary["rows_unequal"] > 0 and "--formats FP8_BLOCK,W8A8,W4A16" in summary["failures"][0]["replay"]


def test_formats_keep_the_dense_draws_and_refuse_fp32():
    """Without --formats the models, hence every draw of a seed, are the families'; fp32 is refused."""
    assert fuzz.parse([]).models == fuzz.TEXT_FAMILIES and fuzz.parse([]).dtypes == list(fuzz.DTYPES)
    # images are not token draws; gemma4's text model is drawn as gemma4_text
    assert set(FAMILIES) - set(fuzz.TEXT_FAMILIES) == {"gemma4", "qwen2_5_vl", "qwen3_vl"}
    args = fuzz.parse(["--formats", "none,W4A16"])
    assert "qwen3_moe" in args.models and "qwen2:W4A16" in args.models and "qwen3_moe:W4A16" not in args.models
    with pytest.raises(SystemExit):
        fuzz.parse(["--formats", "W4A16", "--dtypes", "fp32"])


@pytest.mark.heavy
def test_negative_control_patches_the_quantized_layers_too():
    from benchmarks import fuzz_quantized
    from invariant_infer.model import quantization
    originals = quantization.quantize_activations, quantization.quantized_linear
    with fuzz.batch_variant_linear():
        assert quantization.quantize_activations is fuzz_quantized.per_tensor_activations
        assert quantization.quantized_linear is fuzz_quantized.m_dependent_quantized_linear
    assert (quantization.quantize_activations, quantization.quantized_linear) == originals
