"""The engine, scoring and the commands at TP 2 (CPU, gloo on 127.0.0.1): ``TensorParallelRanks``
with ``Engine`` and ``score_sequences`` (also at TP 4), ``invariant-infer score --tensor-parallel-size 2`` and
``invariant-infer serve --tensor-parallel-size 2`` give bitwise the results of one process, for a dense
model and for a hybrid one (Qwen3.5); serve's check before traffic passes through the ranks.
Faults: a rank killed mid-step or while idle fails the call or the command within seconds, naming
the rank; a rank that cannot start fails the start; SIGTERM stops every rank; no rank outlives its
test. Negative control: ranks whose row-parallel exchange all-reduces each rank's rounded sum (the
order stock tensor parallelism adds in, which depends on the TP size) give other bits, and fail the
check's audit."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from openai import OpenAI

import tp_controls
from helpers.servers import ServerProcess, run_concurrently
from helpers.tokenizer import save_tokenizer
from invariant_infer.model import tensor_parallel
from invariant_infer.model.tensor_parallel import tp_size_of
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.errors import TensorParallelError, UnsupportedModelError
from invariant_infer.checkpoints.loading import load_model
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from invariant_infer.scoring.core import score_sequences
from invariant_infer import cli
from invariant_infer.cli import exit_codes, score as scoring_cli
from invariant_infer.parallel import TensorParallelRanks
from invariant_infer.testing.engine_check import check_engine_invariance

# CPU ranks: refused where transformers would shard onto CUDA GPUs (the GPU check runs the
# tensor_parallel benchmark section on machines with two or more).
pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensor-parallel ranks need a machine "
                                                                   "without CUDA GPUs"),
              pytest.mark.file_minutes(6.8)]  # measured on 2 cores: start it early
# 8 query / 4 KV heads of 16, intermediate 256: TP 1, 2 and 4 divide; 3 does not.
TP_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
FAILS_WITHIN_S = 10.0  # a rank's death ends the call or the command this soon
COMMAND_TIMEOUT = 240


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = save_random_checkpoint(tmp_path_factory.mktemp("tp-ranks") / "qwen2", random_config("qwen2", "tiny",
                                                                                                 **TP_SHAPE), seed=5)
    save_tokenizer(path)
    return str(path)


def rank_processes() -> list[int]:
    """Pids of every live rank process (``python -m invariant_infer.parallel.worker``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"invariant_infer.parallel.worker" in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def ranks_of(pid: int) -> list[int]:
    """The rank processes whose parent is ``pid``."""
    children = []
    for rank_pid in rank_processes():
        try:
            if int(Path(f"/proc/{rank_pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(rank_pid)
        except OSError:
            pass
    return children


def wait_gone(pids: list[int], timeout: float = FAILS_WITHIN_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if p in rank_processes()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def no_orphan_ranks():
    """Every rank this process started is gone when its test ends (killed, and the test failed, if not)."""
    yield
    left = wait_gone(ranks_of(os.getpid()))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"rank processes outlived the test: {left}"


# ---- the engine and scoring through the Python API ---------------------------------------------

PROMPTS = [list(range(5, 12)), [3, 4], list(range(20, 45)), list(range(5, 12)) + [60, 61, 62]]  # 4th: 1st + 3
PARAMS = [SamplingParams(max_tokens=6, temperature=0.8, seed=1, prompt_logprobs=0),
          SamplingParams(max_tokens=4),
          SamplingParams(max_tokens=5, temperature=1.0, seed=7, logprobs=2, prompt_logprobs=1),
          SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, seed=3)]
# 16 tokens a step: long prompts prefill in chunks beside other requests' decode tokens.
ENGINE_OPTIONS = dict(max_num_seqs=3, max_num_batched_tokens=16)


def engine_results(model, executor=None, requests=slice(None)) -> tuple[list, list]:
    outputs = Engine(model, **ENGINE_OPTIONS, executor=executor).generate(PROMPTS[requests], PARAMS[requests])
    scores = score_sequences(model, PROMPTS, prompt_lengths=[1, 1, 4, 2], max_batch_tokens=40, executor=executor)
    return ([(o.token_ids, o.logprobs, o.top_logprobs, o.prompt_logprobs, o.prompt_top_logprobs) for o in outputs],
            [s.token_logprobs for s in scores])


def assert_same(expected, got) -> None:
    (outputs_1, scores_1), (outputs_2, scores_2) = expected, got
    assert outputs_2 == outputs_1  # token ids and every logprob as Python floats: exact equality
    assert all(torch.equal(a, b) for a, b in zip(scores_1, scores_2))


@pytest.fixture(scope="module")
def one_process(checkpoint):
    """engine_results of one process, computed once per (dtype, requests): the bf16 ones are both the
    TP 2 cell's expectation and the control's."""
    cache = {}

    def get(dtype: str, requests: slice = slice(None)) -> tuple[list, list]:
        key = (dtype, requests.start, requests.stop)
        if key not in cache:
            cache[key] = engine_results(load_model(checkpoint, dtype=dtype, device="cpu"), requests=requests)
        return cache[key]
    return get


# fp32 at TP 2: the two-engines and serve tests below. TP 4 (four processes on the test machine's two
# cores) runs the engine on the 2nd and 3rd requests only: the long prompt's prefill chunks beside the
# short one's decode tokens, greedy and sampled with prompt and top logprobs.
@pytest.mark.parametrize("size, dtype, requests", [(2, "bf16", slice(None)), (4, "fp32", slice(1, 3))],
                         ids=["2-bf16", "4-fp32"])
def test_engine_and_scores_at_tp2_and_tp4_are_those_of_one_process(checkpoint, one_process, size, dtype, requests):
    single = one_process(dtype, requests)
    with TensorParallelRanks(checkpoint, size, dtype=dtype, device="cpu") as ranks:
        assert tp_size_of(ranks.model) == ranks.tensor_parallel_size == size and len(ranks.workers) == size - 1
        sharded = engine_results(ranks.model, ranks, requests)
    assert_same(single, sharded)


def test_hybrid_engine_and_scores_at_tp2_are_those_of_one_process(tmp_path):
    """Qwen3.5 (Gated DeltaNet layers beside gated attention) at TP 2: the engine, with a 70-token
    prompt prefilled in chunks across the layers' 64-token chunk boundary beside decode tokens and
    then hit in the prefix cache, and scoring give the bits of one process."""
    path = save_random_checkpoint(tmp_path / "qwen3_5", random_config("qwen3_5_text", "tiny", **TP_SHAPE), seed=5)
    prompts = [list(range(5, 75)), [3, 4], list(range(20, 45))]
    params = [SamplingParams(max_tokens=4, temperature=0.8, seed=1, logprobs=1), SamplingParams(max_tokens=4),
              SamplingParams(max_tokens=5, temperature=1.0, seed=7, logprobs=2, prompt_logprobs=1)]

    def run(model, executor=None):
        engine = Engine(model, **ENGINE_OPTIONS, executor=executor)
        first = [(o.token_ids, o.logprobs, o.top_logprobs, o.prompt_logprobs) for o in engine.generate(prompts, params)]
        again = engine.generate(prompts[:1], params[:1])[0]  # the saved state at token 64: a prefix hit
        assert engine.core.blocks.prefix_hits > 0
        scores = score_sequences(model, prompts, prompt_lengths=[1, 1, 4], max_batch_tokens=40, executor=executor)
        return first, (again.token_ids, again.logprobs), [s.token_logprobs for s in scores]
    single = run(load_model(str(path), dtype="bf16", device="cpu"))
    with TensorParallelRanks(str(path), 2, dtype="bf16", device="cpu") as ranks:
        sharded = run(ranks.model, ranks)
    assert sharded[:2] == single[:2] and single[1] == single[0][0][:2]
    assert all(torch.equal(a, b) for a, b in zip(single[2], sharded[2]))


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_two_engines_on_the_same_ranks_keep_their_own_kv_pages(checkpoint):
    """Each engine's runner has its own pages on every rank: the first engine's prefix hits after a
    second engine ran read the first one's KV, as in one process. The second engine speculates
    (n-gram proposals, accepted and rejected): its verify chunks run on the ranks as in one process.
    A third speculates with a draft model (the checkpoint itself, loaded unsharded in the lead
    process) while the target verifies on the ranks: plain decoding's outputs in one process."""
    params = SamplingParams(max_tokens=4, logprobs=1)  # no prompt logprobs: a repeated prompt hits the cache
    speculated_params = SamplingParams(max_tokens=8, logprobs=1)  # the 2nd prompt's output repeats from token 5
    prompts = [list(range(5, 72)), list(range(100, 167))]  # pages of 64 on CPU: one full page each
    other = [list(range(200, 267)), list(range(200, 216)) * 4]

    def run(model, executor=None):
        first, second = Engine(model, executor=executor), Engine(model, executor=executor, speculative=NGRAM)
        before = [(o.token_ids, o.logprobs) for o in first.generate(prompts, params)]
        speculated = [(o.token_ids, o.logprobs) for o in second.generate(other, speculated_params)]
        after = [(o.token_ids, o.logprobs) for o in first.generate(prompts, params)]  # prefix hits
        assert first.core.blocks.prefix_hits > 0  # the second run of the prompts read cached pages
        stats = second.core.speculative.stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
        return before, after, speculated
    model = load_model(checkpoint, dtype="fp32", device="cpu")
    single = run(model)  # speculation == plain decoding in one process: tests/engine/test_speculative.py
    draft_params = [SamplingParams(max_tokens=5, logprobs=1),
                    SamplingParams(max_tokens=5, temperature=0.9, seed=4, logprobs=1)]
    plain = [(o.token_ids, o.logprobs) for o in Engine(model).generate(other, draft_params)]
    with TensorParallelRanks(checkpoint, 2, dtype="fp32", device="cpu") as ranks:
        assert run(ranks.model, ranks) == single
        drafted = Engine(ranks.model, executor=ranks,
                         speculative={"method": "draft_model", "model": checkpoint, "num_speculative_tokens": 3})
        assert [(o.token_ids, o.logprobs) for o in drafted.generate(other, draft_params)] == plain
        stats = drafted.core.speculative.stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_control_allreduce_exchange_at_tp2_differs(checkpoint, one_process, monkeypatch):
    """The TP 2 bf16 cell above with the control exchange: every rank (this one included) swaps it
    in; monkeypatch restores it here. The check serve runs at TP 2 fails its audit."""
    monkeypatch.setattr(tensor_parallel, "exchange_partials", tensor_parallel.exchange_partials)
    single = one_process("bf16")
    with TensorParallelRanks(checkpoint, 2, dtype="bf16", device="cpu",
                             rank_init=tp_controls.use_allreduce_exchange) as ranks:
        assert tensor_parallel.exchange_partials is tp_controls.allreduce_exchange
        control = engine_results(ranks.model, ranks)
        # serve's check at TP 2 names it: the audit on the ranks finds the all-reduce (its order does
        # not depend on the batch, so rows alone and batched still agree).
        report = check_engine_invariance(Engine(ranks.model, executor=ranks))
        assert report.failed == ["audit"] and "stray op c10d.allreduce_" in str(report), str(report)
    assert control[0] != single[0]
    assert not all(torch.equal(a, b) for a, b in zip(single[1], control[1]))


# ---- faults and refusals -------------------------------------------------------------------------

def test_a_rank_killed_mid_step_fails_the_call_within_seconds(checkpoint):
    failures = []
    with TensorParallelRanks(checkpoint, 2, dtype="fp32", device="cpu", on_failure=failures.append) as ranks:
        # Rank 0's model without its executor would wait forever for the other ranks: refused,
        # saying how to pass the executor; the ranks go on.
        alone = r"runs only through its executor.*pass executor=ranks.*Engine\(ranks.model, tokenizer, executor=ranks\)"
        with pytest.raises(TensorParallelError, match=alone):
            ranks.model(input_ids=torch.tensor([[1, 2, 3]]))
        with pytest.raises(TensorParallelError, match=alone):
            ranks.model.lm_head(torch.zeros(1, TP_SHAPE["hidden_size"]))
        with pytest.raises(TensorParallelError, match=alone):
            Engine(ranks.model).generate([[1, 2, 3]], SamplingParams(max_tokens=1))
        with pytest.raises(TensorParallelError, match=alone):
            score_sequences(ranks.model, [[1, 2, 3]])
        with pytest.raises(ValueError, match="not a worker command"):  # only registered commands travel
            ranks.collective_rpc(print, None, lambda: None)
        assert ranks.failure is None and failures == []
        engine = Engine(ranks.model, executor=ranks)
        worker = ranks.workers[0].pid
        threading.Timer(1.0, os.kill, (worker, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker}\) was killed by SIGKILL"):
            engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=500, ignore_eos=True))
        assert time.monotonic() - start < 1.0 + FAILS_WITHIN_S
        assert len(failures) == 1 and f"pid {worker}" in failures[0]
        with pytest.raises(TensorParallelError, match="every rank is stopped"):  # and every later call
            score_sequences(ranks.model, [[1, 2, 3]], executor=ranks)


def test_a_rank_killed_while_idle_is_reported_within_seconds(checkpoint):
    failed = threading.Event()
    with TensorParallelRanks(checkpoint, 2, dtype="fp32", device="cpu", on_failure=lambda m: failed.set()) as ranks:
        os.kill(ranks.workers[0].pid, signal.SIGKILL)
        assert failed.wait(FAILS_WITHIN_S)
        assert "killed by SIGKILL" in ranks.failure


def test_a_rank_that_cannot_start_fails_the_start(checkpoint):
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 .* failed during starting: RuntimeError: this rank cannot start"):
        TensorParallelRanks(checkpoint, 2, dtype="fp32", device="cpu", rank_init=tp_controls.fail_on_other_ranks)
    assert time.monotonic() - start < 60


def test_refused_sizes_name_the_sizes_that_work(checkpoint, tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"tensor-parallel size 3: .*Sizes that work for this model: "
                                                    r"\[1, 2, 4\]"):
        TensorParallelRanks(checkpoint, 3, device="cpu")
    with pytest.raises(ValueError, match="positive integer"):
        TensorParallelRanks(checkpoint, 0, device="cpu")
    moe = save_random_checkpoint(tmp_path / "moe", random_config("qwen3_moe", "tiny"))
    with pytest.raises(UnsupportedModelError, match="qwen3_moe: tensor parallelism does not run mixture-of-experts"):
        TensorParallelRanks(str(moe), 2, device="cpu")
    assert not ranks_of(os.getpid())  # refused before any process started


# ---- invariant-infer score ------------------------------------------------------------------------

ROWS = 12  # the score job's input: 3 to 29 tokens a row


def score_args(checkpoint: str, inputs: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", checkpoint, "--input", str(inputs), "--output", str(output), "--device", "cpu", "--dtype", "bf16",
            *extra]


def score_command(checkpoint: str, inputs: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "invariant_infer.cli", "score", *score_args(checkpoint, inputs, output, *extra)]


def write_rows(path: Path, count: int) -> Path:
    generator = torch.Generator().manual_seed(4)
    with path.open("w") as f:
        for i in range(count):
            n = int(torch.randint(3, 30, (), generator=generator))
            f.write(json.dumps({"id": f"r{i}", "input_ids": torch.randint(1, 300, (n,), generator=generator).tolist()})
                    + "\n")
    return path


@contextlib.contextmanager
def score_job_with_a_row(checkpoint: str, inputs: Path, output: Path, stderr=subprocess.DEVNULL):
    """A TP 2 score job, yielded (process, its one rank's pid) once it has written a row; the
    job's session is killed on the way out if it still runs."""
    proc = subprocess.Popen(score_command(checkpoint, inputs, output, "--tensor-parallel-size", "2",
                                          "--max-batch-tokens", "24"),
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not (output.exists() and output.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended before writing a row"
            time.sleep(0.05)
        rank = ranks_of(proc.pid)
        assert len(rank) == 1
        yield proc, rank[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def score_in_process(capsys, checkpoint: str, inputs: Path, output: Path, *extra: str) -> str:
    """The score command's ``main`` in this process (it starts and stops its ranks as the command does):
    its stderr. The command as a process runs below, where a rank is killed under it."""
    capsys.readouterr()
    status = scoring_cli.main(score_args(checkpoint, inputs, output, *extra))
    err = capsys.readouterr().err
    assert status == 0, err[-3000:]
    return err


def test_score_command_at_tp2_writes_the_bytes_of_tp1_and_resumes_after_a_rank_dies(checkpoint, tmp_path, capsys):
    """Every row of the TP 2 output (the faulted job's, then the resumed run's) is TP 1's bytes."""
    inputs = write_rows(tmp_path / "in.jsonl", ROWS)
    score_in_process(capsys, checkpoint, inputs, tmp_path / "tp1.jsonl")

    # A rank killed once rows are written: the command fails within seconds, naming it.
    output = tmp_path / "faulted.jsonl"
    with score_job_with_a_row(checkpoint, inputs, output, stderr=subprocess.PIPE) as (proc, rank):
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=COMMAND_TIMEOUT)
    assert time.monotonic() - killed < FAILS_WITHIN_S
    assert proc.returncode == exit_codes.RANK_FAILED
    assert f"tensor-parallel rank 1 (pid {rank}) was killed by SIGKILL" in err and "re-run to resume" in err
    written = output.read_text().count("\n")
    assert 1 <= written < ROWS
    resumed = score_in_process(capsys, checkpoint, inputs, output, "--tensor-parallel-size", "2",
                               "--max-batch-tokens", "64", "--verify", "3")
    assert f"{written} already in output" in resumed and "3 of 3 rows re-scored alone match" in resumed
    assert output.read_bytes() == (tmp_path / "tp1.jsonl").read_bytes()


def test_sigterm_to_the_score_command_stops_every_rank(checkpoint, tmp_path):
    inputs = write_rows(tmp_path / "in.jsonl", ROWS)
    with score_job_with_a_row(checkpoint, inputs, tmp_path / "out.jsonl") as (proc, rank):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(FAILS_WITHIN_S) == -signal.SIGTERM
        assert not wait_gone([rank])


def test_commands_refuse_a_size_before_starting_ranks(checkpoint, tmp_path, capsys):
    inputs = write_rows(tmp_path / "in.jsonl", 2)
    assert scoring_cli.main(score_args(checkpoint, inputs, tmp_path / "out.jsonl", "--tensor-parallel-size", "3")) == 2
    assert "Sizes that work for this model: [1, 2, 4]" in capsys.readouterr().err
    # the command's main in this process: it refuses before any rank or listener starts
    assert cli.main(["serve", "--model", checkpoint, "--port", "0", "--device", "cpu", "--tensor-parallel-size", "3"]) == 2
    assert "Sizes that work for this model: [1, 2, 4]" in capsys.readouterr().err
    assert not ranks_of(os.getpid())


# ---- invariant-infer serve ------------------------------------------------------------------------

REQUESTS = [dict(prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=0.9, seed=3, logprobs=2),
            dict(prompt="the model runs fast", max_tokens=5, temperature=0.0, seed=5, logprobs=1, echo=True),
            dict(prompt=[40, 41, 42], max_tokens=8, temperature=1.0, seed=11, n=2, logprobs=0)]


def completions(server: ServerProcess, checkpoint: str, concurrently: bool) -> list[dict]:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def one(body):
        return client.completions.create(model=checkpoint, **body).model_dump(include={"choices"})
    if not concurrently:
        return [one(body) for body in REQUESTS]
    return run_concurrently(one, REQUESTS)


def test_serve_at_tp2_answers_as_tp1_and_sigterm_stops_every_rank(checkpoint, tmp_path):
    args = ["--model", checkpoint, "--device", "cpu", "--dtype", "fp32"]
    single = ServerProcess(args, tmp_path / "tp1.log")
    try:
        expected = completions(single, checkpoint, concurrently=False)
    finally:
        single.stop()
    server = ServerProcess([*args, "--tensor-parallel-size", "2"], tmp_path / "tp2.log")
    try:
        rank = ranks_of(server.proc.pid)
        assert len(rank) == 1
        checks = [line for line in (tmp_path / "tp2.log").read_text().splitlines() if "serve: check: " in line]
        assert len(checks) == 3 and all("check: PASS  " in line for line in checks), checks  # before it listened
        assert completions(server, checkpoint, concurrently=True) == expected
        update = requests.post(server.url + "/update_weights_from_disk", json={"model_path": checkpoint}, timeout=30)
        assert update.status_code == 400 and "tensor-parallel-size" in update.json()["message"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert not wait_gone(rank)
    finally:
        server.stop()


def test_serve_exits_within_seconds_when_a_rank_dies(checkpoint, tmp_path):
    server = ServerProcess(["--model", checkpoint, "--device", "cpu", "--tensor-parallel-size", "2"],
                           tmp_path / "serve.log")
    try:
        rank = ranks_of(server.proc.pid)
        assert len(rank) == 1
        os.kill(rank[0], signal.SIGKILL)
        start = time.monotonic()
        assert server.proc.wait(FAILS_WITHIN_S * 2) == exit_codes.RANK_FAILED
        assert time.monotonic() - start < FAILS_WITHIN_S
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert f"tensor-parallel rank 1 (pid {rank[0]}) was killed by SIGKILL" in log

