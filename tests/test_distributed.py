"""``invariant-infer score --ray`` and ``distributed.score_dataset`` on a local Ray (2 CPUs, CPU
through the interpreter): 2 workers (one of them killed once and retried) and 1 worker (resuming a
torn output) give the single-process file byte for byte (every row's bits, the error rows with
their line numbers, the row order); --verify; and the Python API on a ``ray.data.from_items``
dataset, row for row equal to score_sequences."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

ray = pytest.importorskip("ray", reason='needs Ray Data: pip install -e ".[ray]"')
pytest.importorskip("ray.data")

from helpers import BAD_LINES, read_rows, score_requests, train_tokenizer, write_jsonl  # noqa: E402

from invariant_infer import scoring_cli  # noqa: E402
from invariant_infer.distributed import CRASH_ONCE_ENV, score_dataset  # noqa: E402
from invariant_infer.patch import make_invariant  # noqa: E402
from invariant_infer.random_checkpoints import qwen2_config, save_random_checkpoint  # noqa: E402
from invariant_infer.scoring import score_sequences  # noqa: E402

FIELDS = ("token_logprobs", "digest", "greedy", "logprob", "num_tokens")


@pytest.fixture(scope="module")
def crash_flag(tmp_path_factory):
    """While this file exists, the first actor to remove it dies (os._exit) before scoring."""
    return tmp_path_factory.mktemp("crash") / "crash-once"


@pytest.fixture(scope="module", autouse=True)
def local_ray(crash_flag):
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {CRASH_ONCE_ENV: str(crash_flag)}})
    from ray.data import DataContext
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


def test_two_workers_with_a_killed_actor(model_dir, reference, crash_flag, tmp_path, capsys):
    """One actor dies on its first task; Ray restarts it and retries the task. Bad lines are
    error rows with their line numbers, as in the single-process job."""
    inp, single = reference
    crash_flag.write_text("die once")
    out = tmp_path / "two.jsonl"
    assert score(model_dir, inp, out, "--ray", "--num-workers", "2", "--max-batch-tokens", "30",
                 "--rows-per-task", "2") == 1
    assert not crash_flag.exists(), "no actor was killed"
    assert_same_file(out, single)
    errors = [r for r in read_rows(out) if "error" in r]
    assert [(r["line"], r["id"]) for r in errors] == [(4, None), (5, "empty"), (13, None)]
    assert "malformed JSON" in errors[0]["error"] and "duplicate id" in errors[2]["error"]
    err = capsys.readouterr().err
    assert f"{inp}:4: malformed JSON" in err and "10 scored" in err and "3 errors" in err


def test_one_worker_resumes_torn_output_and_verifies(model_dir, reference, tmp_path, capsys):
    inp, single = reference
    lines = single.read_bytes().splitlines(keepends=True)
    out = tmp_path / "resumed.jsonl"
    out.write_bytes(b"".join(lines[:6]) + lines[6][:len(lines[6]) // 2])  # a crash mid-write
    assert score(model_dir, inp, out, "--ray", "--num-workers", "1", "--max-batch-tokens", "100000",
                 "--verify", "3") == 1
    err = capsys.readouterr().err
    assert "7 scored, 3 already in output" in err and "verify: 3 of 3 rows re-scored alone match" in err
    assert_same_file(out, single)


def test_score_dataset_api(model_dir):
    rows = [{"id": i, "input_ids": r["input_ids"]} for i, r in enumerate(score_requests(24, seed=2)) if "input_ids" in r]
    rows += [{"id": 100 + i, "input_ids": list(range(1, 3 + 5 * i))} for i in range(4)]
    model = make_invariant(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    expected = dict(zip([r["id"] for r in rows], score_sequences(model, [r["input_ids"] for r in rows])))
    ds = ray.data.from_items(rows, override_num_blocks=3)
    result = score_dataset(ds, str(model_dir), dtype="fp32", num_workers=1, max_batch_tokens=20, batch_size=4)
    got = result.take_all()
    assert sorted(r["id"] for r in got) == sorted(expected)  # one row per id
    for row in got:
        want = expected[row["id"]]
        assert list(row["token_logprobs"]) == want.token_logprobs.tolist()
        assert (row["digest"], bool(row["greedy"]), row["logprob"], row["num_tokens"]) == \
            (want.digest, want.greedy, want.logprob, want.num_tokens)
