"""``invariant-infer serve --tensor-parallel-size 2`` runs its check before traffic through the
ranks (``testing.engine_check``). Negative control: with every rank's projections picking BLOCK_K
by M, the start stops with NOT_INVARIANT, naming the failed checks, before anything listens; with
--skip-check the same server listens. (The passing check is asserted by the TP 2 serve test of
``test_tensor_parallel_ranks.py``, on the server it starts.)"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers.servers import run_bounded
from helpers.tokenizer import save_tokenizer
from invariant_infer.cli import exit_codes
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensor-parallel ranks need a machine "
                                                                   "without CUDA GPUs")]
COMMAND_TIMEOUT = 240


# serve at TP 2 with every rank's projections picking BLOCK_K by M: TensorParallelRanks is given the
# control's rank_init, which rank 0 runs too.
CONTROLLED_TP_SERVE = """
import functools
import sys
sys.path.insert(0, {tests!r})
import tp_controls
from invariant_infer.cli import main
from invariant_infer.server import main as server_main
server_main.TensorParallelRanks = functools.partial(server_main.TensorParallelRanks,
                                                    rank_init=tp_controls.use_m_dependent_linear)
sys.exit(main(sys.argv[1:]))
"""


def test_negative_control_serve_at_tp2_stops_on_a_failing_check_and_skip_check_serves(tmp_path):
    checkpoint = save_random_checkpoint(tmp_path / "qwen2", random_config(
        "qwen2", "tiny", hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16), seed=5)
    save_tokenizer(checkpoint)
    script = CONTROLLED_TP_SERVE.format(tests=str(Path(__file__).parents[1]))
    command = [sys.executable, "-c", script, "serve", "--model", str(checkpoint), "--port", "0", "--device", "cpu",
               "--dtype", "fp32", "--tensor-parallel-size", "2"]
    refused = run_bounded(command, COMMAND_TIMEOUT)
    assert refused.returncode == exit_codes.NOT_INVARIANT, refused.stderr[-3000:]
    assert "check: PASS  audit" in refused.stderr and "check: FAIL  rows of" in refused.stderr
    assert "not batch-invariant here (batch; decode)" in refused.stderr and "listening" not in refused.stdout
    proc = subprocess.Popen([*command, "--skip-check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(COMMAND_TIMEOUT)
        assert line and "listening on http://" in line[0], line
        proc.send_signal(signal.SIGTERM)  # maybe before uvicorn handles it: the exit status is not checked here
        _, err = proc.communicate(timeout=60)
        assert "check:" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
