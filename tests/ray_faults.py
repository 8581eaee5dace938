"""Faults for the Ray tests, put into every Ray worker by Ray's ``worker_process_setup_hook``
(``install``) when ``FAULTS_DIR_ENV`` names a folder. Once a worker imports
``invariant_infer.scoring.core`` (the scoring actors do; the fault ledger does not), its ``score_batch``
is wrapped:

- a batch holding a sequence that starts with ``RAISE_PREFIX`` raises, and one with ``KILL_PREFIX``
  kills its worker (``os._exit``), as poison rows do;
- while ``FOLDER/always-crash`` exists, every call kills its worker;
- a worker leaves ``FOLDER/<pid>`` once it has scored, and ``FOLDER/<pid>.busy`` while a call runs,
  so a test can kill a busy worker from outside.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

FAULTS_DIR_ENV = "TEST_RAY_FAULTS_DIR"
RAISE_PREFIX = [497, 498, 499]
KILL_PREFIX = [507, 508, 509]
MODULE = "invariant_infer.scoring.core"


def wrap(scoring, folder: Path) -> None:
    original = scoring.score_batch

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


class WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the scoring module as it is imported, so workers that never import it stay light."""

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            wrap(module, self.folder)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    folder = os.environ.get(FAULTS_DIR_ENV)
    if folder:
        sys.meta_path.insert(0, WrapOnImport(Path(folder)))
