"""The module names from before the layout by layer still import, as the very modules they became."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from invariant_infer._legacy_names import MOVED, new_name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_is_the_new_module_with_a_warning(old):
    sys.modules.pop(f"invariant_infer.{old}", None)  # an earlier import of the old name (the new one stays)
    with pytest.warns(DeprecationWarning, match=f"invariant_infer.{old} is now invariant_infer.{MOVED[old]}"):
        module = importlib.import_module(f"invariant_infer.{old}")
    assert module is importlib.import_module(f"invariant_infer.{MOVED[old]}")
    assert module.__spec__.name == f"invariant_infer.{MOVED[old]}"


def test_names_users_import():
    code = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
from invariant_infer import make_invariant, restore, score_sequences, generate_invariant, seeded_sampling
from invariant_infer.engine import Engine, AsyncEngine, SamplingParams
from invariant_infer.training import token_logprobs
from invariant_infer.parallel import TensorParallelRanks
from invariant_infer.scoring import score_sequences, ScoreResult, plan_batches
from invariant_infer.kernels import linear, rms_norm, attention, token_logprobs
from invariant_infer.training.integrations.trl import InvariantGRPOTrainer
warnings.simplefilter("ignore", DeprecationWarning)
from invariant_infer.integrations.trl import InvariantGRPOTrainer as old
from invariant_infer.tensor_parallel_ranks import TensorParallelRanks as old_ranks
from invariant_infer.families import FAMILIES
import invariant_infer.patch, invariant_infer.model.patch
assert old is InvariantGRPOTrainer and old_ranks is TensorParallelRanks
assert invariant_infer.patch is invariant_infer.model.patch
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_submodule_of_a_moved_package_and_unknown_names():
    assert new_name("invariant_infer.families.qwen2") == "invariant_infer.model.families.qwen2"
    assert new_name("invariant_infer.engine") is None and new_name("invariant_infer.patchwork") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("invariant_infer.no_such_module")
