"""``invariant-infer score`` end to end on a saved random checkpoint with a locally trained BPE
tokenizer: digests independent of --max-batch-tokens, values near a stock fp32 log_softmax,
the bad-input matrix, a row whose scoring raises, resume after a torn line and after a real
kill -9, and --verify."""
from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from helpers.models import load_model
from helpers.scoring_rows import BAD_LINES, read_rows, score_requests, write_jsonl
from helpers.tokenizer import train_tokenizer
from helpers.unsupported_checkpoints import save_encoder_checkpoint
from invariant_infer.scoring import core as scoring
from invariant_infer.cli import exit_codes, score as scoring_cli
from invariant_infer.testing.random_checkpoints import qwen2_config, save_random_checkpoint

TOLERANCE_VS_STOCK_FP32 = {"bf16": 0.02, "fp16": 3e-3, "fp32": 1e-5}  # as in test_scoring.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("score-qwen2"), qwen2_config("tiny"), seed=3)
    train_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def by_id(rows) -> dict:
    return {json.dumps(r["id"]): r for r in rows if "digest" in r}


def score(model_dir, inp, out, *extra) -> int:
    return scoring_cli.main(["--model", str(model_dir), "--input", str(inp), "--output", str(out), *extra])


def token_ids(request: dict, tokenizer) -> tuple[list[int], int]:
    """The ids and prompt length the CLI should use (documented: separate tokenization, no specials)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    if "input_ids" in request:
        return request["input_ids"], 1
    if "text" in request:
        return enc(request["text"]), 1
    prompt, completion = ((enc(request["prompt"]), enc(request["completion"])) if "prompt" in request
                          else (request["prompt_ids"], request["completion_ids"]))
    return prompt + completion, len(prompt)


@pytest.fixture(scope="module")
def main_job(model_dir, tmp_path_factory):
    """12 requests scored in fp32 with a large budget: the uninterrupted reference."""
    tmp = tmp_path_factory.mktemp("main-job")
    rows = score_requests(12)
    inp = write_jsonl(tmp / "in.jsonl", rows)
    assert score(model_dir, inp, tmp / "big.jsonl", "--max-batch-tokens", "100000", "--dtype", "fp32") == 0
    return rows, inp, tmp / "big.jsonl"


def test_rows_have_documented_fields(main_job, tokenizer):
    requests_, _, out = main_job
    rows = by_id(read_rows(out))
    assert len(rows) == len(requests_) == len(read_rows(out))
    for request in requests_:
        row = rows[json.dumps(request["id"])]
        ids, prompt_length = token_ids(request, tokenizer)
        values = row["token_logprobs"]
        assert row["num_tokens"] == len(values) == len(ids) - prompt_length
        assert row["logprob"] == math.fsum(values)
        assert row["digest"] == hashlib.sha256(np.asarray(values, dtype="<f4").tobytes()).hexdigest()
        assert isinstance(row["greedy"], bool)
        assert all(np.float32(v) == v for v in values)  # JSON floats round-trip to the fp32 bits


def test_digests_independent_of_max_batch_tokens(model_dir, main_job, tmp_path):
    _, inp, big = main_job
    assert score(model_dir, inp, tmp_path / "one.jsonl", "--max-batch-tokens", "1", "--dtype", "fp32") == 0
    assert score(model_dir, inp, tmp_path / "mid.jsonl", "--max-batch-tokens", "50", "--dtype", "fp32") == 0
    reference = by_id(read_rows(big))
    for name in ("one.jsonl", "mid.jsonl"):
        rows = by_id(read_rows(tmp_path / name))
        assert rows.keys() == reference.keys()
        assert all(rows[k]["digest"] == reference[k]["digest"] for k in rows)
    # Rows are written longest first whatever the budget, so whole files are identical too.
    assert (tmp_path / "one.jsonl").read_bytes() == big.read_bytes()


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_close_to_stock_fp32_log_softmax(model_dir, main_job, tokenizer, tmp_path, dtype):
    requests_, inp, big = main_job
    out = big if dtype == "fp32" else tmp_path / "out.jsonl"
    if dtype != "fp32":
        assert score(model_dir, inp, out, "--dtype", dtype, "--max-batch-tokens", "64") == 0
    rows = by_id(read_rows(out))
    stock = load_model(model_dir, torch.float32)  # stock HF, no make_invariant
    worst = 0.0
    for request in requests_:
        ids, prompt_length = token_ids(request, tokenizer)
        with torch.no_grad():
            logprobs = torch.log_softmax(stock(torch.tensor([ids])).logits[0].float(), dim=-1)
        ref = logprobs[prompt_length - 1:-1].gather(1, torch.tensor(ids[prompt_length:])[:, None])[:, 0]
        got = torch.tensor(rows[json.dumps(request["id"])]["token_logprobs"])
        worst = max(worst, (got - ref).abs().max().item())
    assert worst <= TOLERANCE_VS_STOCK_FP32[dtype], worst


def test_bad_input_matrix(model_dir, tmp_path, capsys):
    inp, out = write_jsonl(tmp_path / "in.jsonl", [line for line, _ in BAD_LINES]), tmp_path / "out.jsonl"
    assert score(model_dir, inp, out, "--dtype", "fp32") == 1
    stderr = capsys.readouterr().err
    rows = read_rows(out)
    errors = {r["line"]: r for r in rows if "error" in r}
    expected = {n: match for n, (_, match) in enumerate(BAD_LINES, start=1) if match}
    assert errors.keys() == expected.keys()
    for n, match in expected.items():
        assert match in errors[n]["error"], (n, errors[n])
        assert f"{inp}:{n}: " in stderr and match in stderr
    assert errors[4]["id"] is None and errors[2]["id"] is None and errors[20]["id"] is None  # no id / duplicate
    assert errors[5]["id"] == "unknown" and errors[13]["id"] == "vocab"
    assert sorted(by_id(rows)) == sorted(['"ok1"', "7", '"ok2"'])  # every valid line still scored
    assert "3 scored" in stderr and f"{len(expected)} errors" in stderr and "tokens/s" in stderr

    # Re-run: results are skipped, error rows are re-tried and rewritten, never duplicated.
    assert score(model_dir, inp, out, "--dtype", "fp32") == 1
    again = read_rows(out)
    assert sorted(json.dumps(r) for r in again) == sorted(json.dumps(r) for r in rows)
    ids = [json.dumps(r["id"]) for r in again if r["id"] is not None]
    assert len(ids) == len(set(ids))
    assert "0 scored, 3 already in output" in capsys.readouterr().err


def test_row_whose_scoring_raises_is_an_error_row(model_dir, main_job, tmp_path, monkeypatch, capsys):
    """Its batch is scored again row by row: the others keep their bits, it alone fails."""
    _, inp, big = main_job
    original = scoring.score_batch

    def score_batch(model, sequences, prompt_lengths, **kwargs):
        if any(list(seq[:2]) == [510, 511] for seq in sequences):
            raise RuntimeError("poison row")
        return original(model, sequences, prompt_lengths, **kwargs)

    monkeypatch.setattr(scoring, "score_batch", score_batch)
    lines = open(inp).read().splitlines() + ['{"id": "poison", "input_ids": [510, 511, 3, 4]}']
    out = tmp_path / "out.jsonl"
    assert score(model_dir, write_jsonl(tmp_path / "in.jsonl", lines), out, "--dtype", "fp32",
                 "--max-batch-tokens", "100000") == 1  # one batch: the poison row with all the others
    error = {"id": "poison", "line": 13, "error": "scoring failed: RuntimeError: poison row"}
    assert out.read_bytes() == (json.dumps(error) + "\n").encode() + big.read_bytes()
    assert ":13: scoring failed: RuntimeError: poison row" in capsys.readouterr().err


def test_out_of_memory_ends_the_job_without_retrying_rows(model_dir, main_job, tmp_path, monkeypatch, capsys):
    """No row's fault: exit 2 naming it, and the batch is not scored again row by row."""
    _, inp, _ = main_job
    calls = []

    def score_batch(model, sequences, prompt_lengths, **kwargs):
        calls.append(len(sequences))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(scoring, "score_batch", score_batch)
    assert score(model_dir, inp, tmp_path / "out.jsonl", "--dtype", "fp32", "--max-batch-tokens", "100000") == 2
    assert len(calls) == 1 and calls[0] > 1
    err = capsys.readouterr().err
    assert "out of memory" in err and "OutOfMemoryError" in err and "re-run to resume" in err


def test_invalid_utf8_fails_its_line_only(model_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b'{"id": 1, "input_ids": [1, 2, 3]}\n{"id": 2, "text": "caf\xe9"}\n{"id": 3, "input_ids": [4, 5]}\n')
    assert score(model_dir, inp, out, "--dtype", "fp32") == 1
    rows = read_rows(out)
    assert sorted(by_id(rows)) == ["1", "3"]
    assert [r["line"] for r in rows if "error" in r] == [2]
    assert f"{inp}:2: not valid UTF-8" in capsys.readouterr().err


def test_fatal_errors_exit_2_before_loading(tmp_path, capsys):
    missing_model = tmp_path / "no-model"  # never loaded: the input check comes first
    assert score(missing_model, tmp_path / "missing.jsonl", tmp_path / "out.jsonl") == 2
    assert "cannot read --input" in capsys.readouterr().err
    inp = write_jsonl(tmp_path / "in.jsonl", ['{"id": 1, "input_ids": [1, 2]}'])
    assert score(missing_model, inp, tmp_path / "no-such-dir" / "out.jsonl") == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_repairs_torn_last_line(model_dir, main_job, tmp_path):
    _, inp, big = main_job
    data = big.read_bytes()
    lines = data.splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(lines[:5]) + lines[5][:len(lines[5]) // 2])  # as a crash mid-write leaves it
    assert score(model_dir, inp, out, "--dtype", "fp32", "--max-batch-tokens", "7") == 0
    rows = read_rows(out)
    assert len(rows) == len(lines) and by_id(rows) == by_id(read_rows(big))
    assert out.read_bytes() == big.read_bytes()  # rewritten in the canonical order


@pytest.mark.heavy
def test_kill_9_then_resume(model_dir, main_job, tmp_path):
    _, inp, big = main_job
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "invariant_infer.cli.score", "--model", str(model_dir), "--input", inp,
           "--output", str(out), "--dtype", "fp32", "--max-batch-tokens", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (out.exists() and out.read_bytes().count(b"\n") >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "job ended before it could be killed"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    partial = read_rows(out) if out.read_bytes().endswith(b"\n") else None
    assert partial is None or len(partial) < 12  # killed in the middle of the job

    assert score(model_dir, inp, out, "--dtype", "fp32", "--max-batch-tokens", "30") == 0
    rows = read_rows(out)
    ids = [json.dumps(r["id"]) for r in rows]
    assert len(ids) == len(set(ids)) == 12  # every id exactly once
    digests = lambda rows: {k: r["digest"] for k, r in by_id(rows).items()}  # noqa: E731
    assert digests(rows) == digests(read_rows(big))  # equal to the uninterrupted run
    assert out.read_bytes() == big.read_bytes()  # byte for byte


def test_verify_confirms_and_detects_mismatch(model_dir, main_job, tmp_path, capsys):
    _, inp, big = main_job
    out = tmp_path / "out.jsonl"
    out.write_bytes(big.read_bytes())
    assert score(model_dir, inp, out, "--dtype", "fp32", "--verify", "3") == 0
    assert "verify: 3 of 3 rows re-scored alone match their digests bitwise" in capsys.readouterr().err
    rows = read_rows(out)
    rows[0]["digest"] = "0" * 64  # a stored result that the model no longer reproduces
    write_jsonl(out, rows)
    assert score(model_dir, inp, out, "--dtype", "fp32", "--verify", "12") == exit_codes.VERIFY_MISMATCH
    assert "verify: MISMATCH: 1 of 12" in capsys.readouterr().err


def test_text_lines_without_tokenizer_fail_alone(model_dir, tmp_path, capsys):
    bare = save_random_checkpoint(tmp_path / "bare", qwen2_config("tiny"), seed=3)  # same weights, no tokenizer
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "the cat"}, {"id": 2, "input_ids": [1, 2, 3]}])
    assert score(bare, inp, tmp_path / "out.jsonl", "--dtype", "fp32") == 1
    rows = read_rows(tmp_path / "out.jsonl")
    assert "cannot tokenize" in rows[0]["error"] and rows[1]["id"] == 2 and "digest" in rows[1]
    assert score(bare, inp, tmp_path / "out2.jsonl", "--dtype", "fp32", "--tokenizer", str(model_dir)) == 0


def test_a_masked_lm_checkpoint_is_refused_by_name_before_any_row(tmp_path, capsys):
    """Neither a causal LM nor a pooled checkpoint (a classification head is scored as one: test_score_pooled.py):
    refused, its architecture named, nothing written."""
    path = save_encoder_checkpoint(tmp_path / "mlm")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": [1, 2, 3]}])
    assert score(path, inp, tmp_path / "out.jsonl") == exit_codes.UNSUPPORTED_MODEL
    assert "model_type 'bert' (BertForMaskedLM)" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.heavy
def test_registered_as_invariant_infer_subcommand(model_dir, main_job, tmp_path):
    from invariant_infer.cli import main
    _, inp, big = main_job
    out = tmp_path / "out.jsonl"
    assert main(["score", "--model", str(model_dir), "--input", inp, "--output", str(out), "--dtype", "fp32"]) == 0
    assert out.read_bytes() == big.read_bytes()
