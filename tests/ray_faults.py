"""Faults for the Ray tests, put into every Ray worker by Ray's ``worker_process_setup_hook``
(``install``) when ``FAULTS_DIR_ENV`` names a folder. It wraps ``invariant_infer.scoring.score_batch``:

- a batch holding a sequence that starts with ``RAISE_PREFIX`` raises, and one with ``KILL_PREFIX``
  kills its worker (``os._exit``), as poison rows do;
- while ``FOLDER/always-crash`` exists, every call kills its worker;
- a worker leaves ``FOLDER/<pid>`` once it has scored, and ``FOLDER/<pid>.busy`` while a call runs,
  so a test can kill a busy worker from outside.
"""
from __future__ import annotations

import os
from pathlib import Path

FAULTS_DIR_ENV = "TEST_RAY_FAULTS_DIR"
RAISE_PREFIX = [497, 498, 499]
KILL_PREFIX = [507, 508, 509]


def install() -> None:
    folder = os.environ.get(FAULTS_DIR_ENV)
    if not folder:
        return
    from invariant_infer import scoring

    original = scoring.score_batch
    folder = Path(folder)

    def score_batch(model, sequences, prompt_lengths, **kwargs):
        heads = [list(seq[:3]) for seq in sequences]
        if (folder / "always-crash").exists() or KILL_PREFIX in heads:
            os._exit(1)
        if RAISE_PREFIX in heads:
            raise RuntimeError("poison row")
        busy = folder / f"{os.getpid()}.busy"
        busy.touch()
        try:
            return original(model, sequences, prompt_lengths, **kwargs)
        finally:
            (folder / str(os.getpid())).touch()
            busy.unlink()

    scoring.score_batch = score_batch
