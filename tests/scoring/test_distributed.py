"""``invariant-infer score --ray`` and ``distributed.score_dataset`` on a local Ray (2 CPUs, CPU
through the interpreter). 2 workers, one of them killed from outside mid-task (SIGKILL), and 1
worker resuming a torn output give the single-process file byte for byte (every row's bits, the
error rows with their line numbers, the row order); poison rows (one whose scoring raises, one
that kills its worker every time) become error rows; --verify; a worker that always dies ends
the job after --max-restarts, the rows already written kept; the Python API on a
``ray.data.from_items`` dataset is row for row equal to score_sequences. Faults are put into the
workers by ``ray_faults`` through Ray's worker_process_setup_hook."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.data import DataContext

from helpers.models import load_model
from helpers.scoring_rows import BAD_LINES, read_rows, score_requests, write_jsonl
from helpers.tokenizer import train_tokenizer
from invariant_infer.cli import score as scoring_cli
from invariant_infer.scoring.job.ray import KILLED_ALONE, score_dataset
from invariant_infer.model.patch import make_invariant
from invariant_infer.testing.random_checkpoints import qwen2_config, save_random_checkpoint
from invariant_infer.scoring.core import score_sequences
from ray_faults import FAULTS_DIR_ENV, KILL_PREFIX, RAISE_PREFIX

# fresh_worker: ray.init forks this process to start Ray's head, which needs its memory committed again
pytestmark = [pytest.mark.heavy, pytest.mark.file_minutes(2.2), pytest.mark.fresh_worker]

FIELDS = ("token_logprobs", "digest", "greedy", "logprob", "num_tokens")


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray-faults")


@pytest.fixture(scope="module", autouse=True)
def local_ray(faults):
    tests = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, FAULTS_DIR_ENV: str(faults)},
                          "worker_process_setup_hook": "ray_faults.install"})
    DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("ray-qwen2"), qwen2_config("tiny"), seed=5)
    train_tokenizer(path)
    return path


def score(model_dir, inp, out, *extra) -> int:
    return scoring_cli.main(["--model", str(model_dir), "--input", str(inp), "--output", str(out),
                             "--dtype", "fp32", *extra])


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The single-process job over 10 requests of every shape and three bad lines."""
    tmp = tmp_path_factory.mktemp("reference")
    lines = score_requests(10, seed=1)
    lines[3:3] = [BAD_LINES[1][0], BAD_LINES[8][0]]  # malformed JSON, empty sequence
    lines.append('{"id": 3, "input_ids": [1, 2]}')  # a duplicate id
    inp = write_jsonl(tmp / "in.jsonl", lines)
    assert score(model_dir, inp, tmp / "single.jsonl", "--max-batch-tokens", "50") == 1
    return inp, tmp / "single.jsonl"


def assert_same_file(path, reference_path):
    rows, expected = read_rows(path), read_rows(reference_path)
    assert [json.dumps(r["id"]) for r in rows] == [json.dumps(r["id"]) for r in expected]  # no row lost or doubled
    for row, want in zip(rows, expected):
        assert {k: row.get(k) for k in FIELDS} == {k: want.get(k) for k in FIELDS}, row["id"]
    assert path.read_bytes() == reference_path.read_bytes()  # and the documented order, byte for byte


def kill_a_busy_worker(faults: Path, out: Path, killed: list, stop: threading.Event) -> None:
    """Once a result row is written, SIGKILL a worker in the middle of scoring a batch."""
    while not stop.is_set():
        if out.exists() and b'"digest"' in out.read_bytes():
            for busy in faults.glob("*.busy"):
                pid = int(busy.name.split(".")[0])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it finished that batch and its worker is gone
                    continue
                killed.append(pid)
                return
        time.sleep(0.01)


def test_two_workers_with_a_worker_killed_mid_task(model_dir, reference, faults, tmp_path, capsys):
    """A worker killed from outside while scoring: Ray restarts it and retries the task. Bad
    lines are error rows with their line numbers, as in the single-process job."""
    inp, single = reference
    out = tmp_path / "two.jsonl"
    killed, stop = [], threading.Event()
    killer = threading.Thread(target=kill_a_busy_worker, args=(faults, out, killed, stop))
    killer.start()
    try:
        assert score(model_dir, inp, out, "--ray", "--num-workers", "2", "--max-batch-tokens", "30",
                     "--rows-per-task", "2") == 1
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was killed while scoring"
    scored_by = {p.name for p in faults.iterdir() if p.name.isdigit()}
    assert len(scored_by - {str(pid) for pid in killed}) >= 2, "the killed worker's task was not retried"
    assert_same_file(out, single)
    errors = [r for r in read_rows(out) if "error" in r]
    assert [(r["line"], r["id"]) for r in errors] == [(4, None), (5, "empty"), (13, None)]
    assert "malformed JSON" in errors[0]["error"] and "duplicate id" in errors[2]["error"]
    err = capsys.readouterr().err
    assert f"{inp}:4: malformed JSON" in err and "10 scored" in err and "3 errors" in err


def test_one_worker_resumes_torn_output_with_poison_rows_and_verifies(model_dir, reference, tmp_path, capsys):
    """Two poison rows appended to the input: one whose scoring raises, one that kills its worker
    each time (in its batch, then alone). Both end as error rows, the job ends, and without them
    the file is the single-process one byte for byte."""
    inp, single = reference
    poison = [{"id": "raises", "input_ids": RAISE_PREFIX + [1, 2]}, {"id": "kills", "input_ids": KILL_PREFIX + [1, 2]}]
    poisoned = write_jsonl(tmp_path / "in.jsonl", Path(inp).read_text().splitlines() + poison)
    lines = single.read_bytes().splitlines(keepends=True)
    out = tmp_path / "resumed.jsonl"
    out.write_bytes(b"".join(lines[:6]) + lines[6][:len(lines[6]) // 2])  # a crash mid-write
    assert score(model_dir, poisoned, out, "--ray", "--num-workers", "1", "--max-batch-tokens", "100000",
                 "--verify", "3") == 1
    err = capsys.readouterr().err
    assert "7 scored, 3 already in output, 5 errors" in err and "verify: 3 of 3 rows re-scored alone match" in err
    assert f"{poisoned}:15: {KILLED_ALONE}" in err
    rows = out.read_bytes().splitlines(keepends=True)
    poisoned_rows = [json.loads(line) for line in rows if b'"line": 14,' in line or b'"line": 15,' in line]
    assert poisoned_rows == [{"id": "raises", "line": 14, "error": "scoring failed: RuntimeError: poison row"},
                             {"id": "kills", "line": 15, "error": KILLED_ALONE}]
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"".join(line for line in rows if json.loads(line) not in poisoned_rows))
    assert_same_file(clean, single)


def test_always_dying_worker_ends_the_job_keeping_rows(model_dir, reference, faults, tmp_path, capsys):
    inp, single = reference
    kept = single.read_bytes().splitlines(keepends=True)[:6]
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(kept))
    (faults / "always-crash").touch()
    try:
        assert score(model_dir, inp, out, "--ray", "--num-workers", "1", "--max-restarts", "1") == 2
    finally:
        (faults / "always-crash").unlink()
    assert "score: a Ray worker died after 1 restarts (--max-restarts)" in capsys.readouterr().err
    rows = out.read_bytes().splitlines(keepends=True)
    assert [line for line in rows if b'"digest"' in line] == [line for line in kept if b'"digest"' in line]


def test_score_dataset_api(model_dir):
    """Row for row equal to score_sequences; an invalid row and a row whose scoring raises (in a
    batch with others, which are then scored alone) are error rows."""
    rows = [{"id": 200, "input_ids": [5, 6, 7]}, {"id": 201, "input_ids": [8, 9]}]  # batched with "raises"
    rows += [{"id": i, "input_ids": r["input_ids"]} for i, r in enumerate(score_requests(24, seed=2)) if "input_ids" in r]
    rows += [{"id": 100 + i, "input_ids": list(range(1, 3 + 5 * i))} for i in range(4)]
    model = make_invariant(load_model(model_dir, torch.float32))
    expected = dict(zip([r["id"] for r in rows], score_sequences(model, [r["input_ids"] for r in rows])))
    bad = [{"id": "vocab", "input_ids": [1, 512]}, {"id": "raises", "input_ids": RAISE_PREFIX + [4]}]
    ds = ray.data.from_items(bad + rows, override_num_blocks=3)
    result = score_dataset(ds, str(model_dir), dtype="fp32", num_workers=1, max_batch_tokens=20, batch_size=4)
    got = {row["id"]: row for row in result.take_all()}
    assert sorted(got, key=str) == sorted(list(expected) + ["vocab", "raises"], key=str)  # one row per id
    assert "outside the vocabulary" in got["vocab"]["error"] and got["vocab"]["digest"] is None
    assert got["raises"]["error"] == "scoring failed: RuntimeError: poison row"
    for row_id, want in expected.items():
        row = got[row_id]
        assert row["error"] is None and list(row["token_logprobs"]) == want.token_logprobs.tolist()
        assert (row["digest"], bool(row["greedy"]), row["logprob"], row["num_tokens"]) == \
            (want.digest, want.greedy, want.logprob, want.num_tokens)
