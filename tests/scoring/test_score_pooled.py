"""``invariant-infer score`` on pooled checkpoints: an embedder's lines get an ``embedding``, a cross-encoder's
and a reward model's ``scores``, each with the digest of its float32 values. The file is byte for byte the
same at two --max-batch-tokens, after a resume from a torn file, on --ray and through the installed command;
each row equals its row computed alone (``PooledModel``). Options pooled checkpoints do not take are refused."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.pooled_checkpoints import PAIRS, TEXTS, save_pooled_checkpoint
from helpers.scoring_rows import read_rows, write_jsonl
from invariant_infer.checkpoints.pooled_loading import load_pooled_model
from invariant_infer.cli import exit_codes, score as scoring_cli
from invariant_infer.scoring.core import logprob_digest

# fresh_worker: its --ray test's ray.init forks this process to start Ray's head (memory committed again)
pytestmark = pytest.mark.fresh_worker

SMALL_BUDGET = 24  # tokens per batch: rows of 3 to 12 tokens run in batches of 1 to 8


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return save_pooled_checkpoint("bert-embedder", tmp_path_factory.mktemp("pooled-score"))


def embedder_lines(pooled) -> list:
    too_long = [5] * (pooled.max_length + 1)
    return [{"id": "t0", "text": TEXTS[0]}, {"id": 1, "text_1": PAIRS[1][0], "text_2": PAIRS[1][1]},
            {"id": "ids", "input_ids": [2, 7, 8, 3], "token_type_ids": [0, 0, 0, 0]},
            {"id": "t2", "text": TEXTS[2]}, '{"id": "bad", "prompt": "the"}',
            {"id": "long", "input_ids": too_long}, {"id": "t4", "text": TEXTS[4]}, {"id": "t5", "text": TEXTS[5]}]


def score(model, inp, out, *extra) -> int:
    return scoring_cli.main(["--model", str(model), "--input", str(inp), "--output", str(out), *extra])


@pytest.fixture(scope="module")
def embedder_job(embedder, tmp_path_factory):
    """The embedder's job at a budget of one batch: (input file, output file)."""
    tmp = tmp_path_factory.mktemp("embed-job")
    pooled = load_pooled_model(embedder, device="cpu")
    inp = write_jsonl(tmp / "in.jsonl", embedder_lines(pooled))
    assert score(embedder, inp, tmp / "big.jsonl", "--max-batch-tokens", "100000") == exit_codes.ROW_ERRORS
    return inp, tmp / "big.jsonl"


def test_embedding_rows_equal_each_row_alone(embedder, embedder_job):
    rows = read_rows(embedder_job[1])
    errors = {row["id"]: row["error"] for row in rows if "error" in row}
    assert set(errors) == {"bad", "long"} and "unknown field(s) ['prompt']" in errors["bad"]
    assert "longer than the model's maximum of 128 tokens" in errors["long"]
    pooled = load_pooled_model(embedder, device="cpu")
    inputs = {"t0": pooled.tokenize(TEXTS[0]), 1: pooled.tokenize_pair(*PAIRS[1])}
    for row in rows:
        if row["id"] in inputs:
            alone = pooled.embeddings(pooled.forward_rows([inputs[row["id"]]]))[0]
            assert torch.equal(torch.tensor(row["embedding"], dtype=torch.float32), alone)
            assert row["digest"] == logprob_digest(alone) and row["num_tokens"] == len(inputs[row["id"]].input_ids)
            assert set(row) == {"id", "embedding", "num_tokens", "digest"}


def test_the_file_is_byte_identical_at_another_budget_and_after_a_resume(embedder, embedder_job, tmp_path):
    inp, big = embedder_job
    small = tmp_path / "small.jsonl"
    assert score(embedder, inp, small, "--max-batch-tokens", str(SMALL_BUDGET)) == exit_codes.ROW_ERRORS
    assert small.read_bytes() == big.read_bytes()
    lines = big.read_bytes().splitlines(keepends=True)
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(b"".join(lines[2:5]) + lines[5][:20])  # three rows kept, a torn fourth
    assert score(embedder, inp, torn, "--max-batch-tokens", str(SMALL_BUDGET)) == exit_codes.ROW_ERRORS
    assert torn.read_bytes() == big.read_bytes()


def test_options_pooled_checkpoints_do_not_take_are_refused(embedder, embedder_job, tmp_path, capsys):
    inp, _ = embedder_job
    assert score(embedder, inp, tmp_path / "a.jsonl", "--lora", f"a={tmp_path}") == exit_codes.REFUSED
    assert "--lora is not supported for a pooled checkpoint (embed)" in capsys.readouterr().err
    assert score(embedder, inp, tmp_path / "b.jsonl", "--task", "classify") == exit_codes.UNSUPPORTED_MODEL
    assert "the classify task needs a sequence-classification head" in capsys.readouterr().err
    assert not (tmp_path / "a.jsonl").exists() and not (tmp_path / "b.jsonl").exists()


# ---- heads, --ray and the command (heavy) -------------------------------------------------------------

@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooled-heads")
    return {kind: save_pooled_checkpoint(kind, root) for kind in ("xlm-roberta-cross-encoder", "qwen3-reward")}


@pytest.mark.heavy
@pytest.mark.parametrize("kind, lines", [
    ("xlm-roberta-cross-encoder", [{"id": i, "text_1": a, "text_2": b} for i, (a, b) in enumerate(PAIRS[:5])]),
    ("qwen3-reward", [{"id": i, "text": text} for i, text in enumerate(TEXTS[:5])])])
def test_head_scores_equal_each_row_alone_at_two_budgets(heads, kind, lines, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    assert score(heads[kind], inp, tmp_path / "big.jsonl", "--max-batch-tokens", "100000") == exit_codes.OK
    assert score(heads[kind], inp, tmp_path / "small.jsonl", "--max-batch-tokens", "12") == exit_codes.OK
    assert (tmp_path / "small.jsonl").read_bytes() == (tmp_path / "big.jsonl").read_bytes()
    pooled = load_pooled_model(heads[kind], device="cpu")
    for row in read_rows(tmp_path / "big.jsonl"):
        line = lines[row["id"]]
        inp_row = pooled.tokenize_pair(line["text_1"], line["text_2"]) if "text_1" in line else \
            pooled.tokenize(line["text"])
        assert torch.equal(torch.tensor(row["scores"], dtype=torch.float32), pooled.forward_rows([inp_row])[0])


@pytest.mark.heavy
def test_ray_and_the_installed_command_write_the_same_bytes(embedder, embedder_job, tmp_path):
    import ray
    inp, big = embedder_job
    tests = str(Path(__file__).resolve().parents[1])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": tests}})
    try:
        assert score(embedder, inp, tmp_path / "ray.jsonl", "--ray", "--num-workers", "1", "--rows-per-task", "3",
                     "--max-batch-tokens", str(SMALL_BUDGET)) == exit_codes.ROW_ERRORS
    finally:
        ray.shutdown()
    assert (tmp_path / "ray.jsonl").read_bytes() == big.read_bytes()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "invariant_infer.cli", "score", "--model", str(embedder), "--input", inp,
                           "--output", str(tmp_path / "cli.jsonl")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == exit_codes.ROW_ERRORS, done.stderr
    assert (tmp_path / "cli.jsonl").read_bytes() == big.read_bytes()
