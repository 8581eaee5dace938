"""The bits of fixed models equal the committed golden digests (tests/golden/digests.json).

Any change of bits fails here until the digests are regenerated on purpose
(``python -m benchmarks.golden_digests --write``) with an entry in BITS.md."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import invariant_infer.model.patch
from benchmarks import golden_digests as golden
from helpers.controls import m_dependent_linear

pytestmark = pytest.mark.file_minutes(1.1)  # measured on 2 cores: start it early


def _check(device: str) -> None:
    key = golden.backend_key(device)
    current = golden.compute(device)
    problem = golden.explain(key, golden.load().get(key), current, golden.environment(device))
    if problem:
        pytest.fail(problem, pytrace=False)


def test_cpu_digests_equal_golden():
    """Every family, bf16 and fp32, alone and in three batchings, and the engine: the CPU
    interpreter's bits are those recorded."""
    _check("cpu")


@pytest.mark.gpu
def test_cuda_digests_equal_golden():
    """This GPU and toolchain's bits are those recorded; a GPU with no entry fails and says how
    to record one."""
    _check("cuda")


def test_a_changed_reduction_order_moves_digests(monkeypatch):
    """Negative control: projections whose BLOCK_K follows M (BLOCK_K 16 for M <= 4, else the
    fixed 64) change the bits of the short samples run alone, and the check names them."""
    monkeypatch.setattr(invariant_infer.model.patch, "linear", m_dependent_linear)
    current = golden.compute("cpu", families=["qwen2"], dtypes=["fp32"], engine=False)
    recorded = golden.load()["cpu-interpreter"]
    entry = {**recorded, "digests": {k: recorded["digests"][k] for k in current}}
    problem = golden.explain("cpu-interpreter", entry, current, golden.environment("cpu"))
    assert problem is not None and "moved:   qwen2/fp32/alone" in problem
    assert golden.REGENERATE in problem and "BITS.md" in problem


def test_checkpoints_hold_the_formula(tmp_path):
    """Every weight read back from the checkpoint is the formula's value (no library init leaks in)."""
    path = golden.write_checkpoint("llama", torch.bfloat16, tmp_path / "llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        expected = golden.parameter_values(name, tuple(param.shape))
        assert torch.equal(param.float(), expected), name


def test_a_missing_backend_is_reported():
    problem = golden.explain("cuda/Some GPU/torch-x", None, {"a": "0"}, {})
    assert "no golden digests recorded" in problem and "--device cuda" in problem
