"""What ``invariant-infer serve`` checks before it takes traffic: a checkpoint of an architecture it
does not run is refused by name before it loads; the check of ``invariant-infer check`` runs on the
loaded model, and a failing check (the negative control: a linear kernel whose BLOCK_K depends on M)
stops the start before the socket listens, while ``--skip-check`` serves anyway.

In process, uvicorn's run is replaced by a stand-in that records the start and returns, and the
engine's thread is not started; the heavy tier runs the real command in a subprocess."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.tokenizer import train_tokenizer
from helpers.unsupported_checkpoints import save_encoder_checkpoint, save_sequence_classification_checkpoint
from invariant_infer.cli import exit_codes
from invariant_infer.cli.serve import main as serve_main
from invariant_infer.server import main as server_main


@pytest.fixture
def started(monkeypatch):
    """Records whether serve reached uvicorn's run (the socket listening), which then returns at once."""
    runs = []

    def run(self, sockets):
        runs.append(sockets[0].getsockname())
        sockets[0].close()
    monkeypatch.setattr(server_main.DrainingServer, "run", run)
    monkeypatch.setattr(server_main, "AsyncEngine", lambda engine: engine)  # no engine thread left behind
    monkeypatch.setattr(server_main, "create_app", lambda engine, tokenizer, options: object())
    return runs


def serve(checkpoint, *extra) -> int:
    return serve_main(["--model", str(checkpoint), "--dtype", "fp32", "--device", "cpu", "--port", "0", *extra])


def test_an_architecture_no_route_serves_is_refused_by_name(tmp_path, capsys, started):
    assert serve(save_encoder_checkpoint(tmp_path / "masked-lm")) == exit_codes.UNSUPPORTED_MODEL
    err = capsys.readouterr().err
    assert "BertForMaskedLM is not a pooled architecture" in err
    assert "Traceback" not in err and not started


@pytest.mark.parametrize("control", [False, True], ids=["invariant", "negative-control"])
def test_a_classification_checkpoint_is_checked_and_served_as_a_pooled_model(tmp_path, capsys, started, monkeypatch,
                                                                             control):
    """A sequence-classification checkpoint is served on the pooling routes after the pooled check (rows
    alone == in padded batches); with a linear whose K block follows the batch size the check stops it."""
    monkeypatch.setattr(server_main, "create_pooling_app", lambda engine, options: engine.shutdown() or object())
    if control:
        monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    path = save_sequence_classification_checkpoint(tmp_path / "cls")
    train_tokenizer(path)
    status = serve(path)
    err = capsys.readouterr().err
    checks = [line for line in err.splitlines() if "serve: check: " in line]
    assert len(checks) == 2, err
    if control:
        assert status == exit_codes.NOT_INVARIANT and not started and any("check: FAIL" in c for c in checks)
    else:
        assert status == exit_codes.OK and len(started) == 1 and all("check: PASS" in c for c in checks), err


def test_the_check_runs_before_serving(checkpoint, capsys, started):
    assert serve(checkpoint) == exit_codes.OK and len(started) == 1
    captured = capsys.readouterr()
    checks = [line for line in captured.err.splitlines() if "serve: check: " in line]
    assert len(checks) == 4 and all("check: PASS  " in line for line in checks), captured.err
    assert "listening on http://127.0.0.1:" in captured.out


def test_negative_control_a_failing_check_stops_the_start(checkpoint, capsys, started, monkeypatch):
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    assert serve(checkpoint) == exit_codes.NOT_INVARIANT and not started
    captured = capsys.readouterr()
    assert "check: FAIL  rows of" in captured.err and "not batch-invariant here (left padding" in captured.err
    assert "listening" not in captured.out


def test_skip_check_serves_without_the_check(checkpoint, capsys, started, monkeypatch):
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    assert serve(checkpoint, "--skip-check") == exit_codes.OK and len(started) == 1
    captured = capsys.readouterr()
    assert "check:" not in captured.err and "listening on" in captured.out


# The real command with the negative control patched in: exits NOT_INVARIANT before it listens, and
# with --skip-check listens.
CONTROLLED_SERVE = """
import sys
sys.path.insert(0, {tests!r})
import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from invariant_infer.cli import main
invariant_infer.model.layer_forwards.linear = m_dependent_linear
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.heavy
def test_the_serve_command_stops_on_a_failing_check_and_serves_with_skip_check(checkpoint, tmp_path):
    script = CONTROLLED_SERVE.format(tests=str(Path(__file__).parents[1]))
    command = [sys.executable, "-c", script, "serve", "--model", str(checkpoint), "--dtype", "fp32", "--port", "0"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode == exit_codes.NOT_INVARIANT, refused.stderr
    assert "check: FAIL" in refused.stderr and "listening" not in refused.stdout
    proc = subprocess.Popen([*command, "--skip-check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(300)
        assert line and re.search(r"listening on http://127\.0\.0\.1:\d+", line[0]), line
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
