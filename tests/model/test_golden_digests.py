"""The bits of fixed models equal the committed golden digests (tests/golden/digests.json).

Any change of bits fails here until the digests are regenerated on purpose
(``python -m benchmarks.golden_digests --write``) with an entry in BITS.md."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import invariant_infer.model.layer_forwards
from benchmarks import golden_digests as golden
from helpers.controls import m_dependent_linear

pytestmark = pytest.mark.file_minutes(1.1)  # measured on 2 cores: start it early


def _check(device: str, part: str | None = None) -> None:
    """The digests of one part ("family/dtype", or "quant": the quantized formats), or of all,
    against the recorded entry's digests of that part."""
    key = golden.backend_key(device)
    if part is None:
        current = golden.compute(device)
    elif part == "quant":
        current = golden.compute(device, families=[], quantized=True)
    else:
        family, dtype = part.split("/")
        current = golden.compute(device, families=[family], dtypes=[dtype], quantized=False)
    entry = golden.load().get(key)
    if entry is not None and part is not None:
        entry = {**entry, "digests": {k: v for k, v in entry["digests"].items() if part_of(k) == part}}
    problem = golden.explain(key, entry, current, golden.environment(device))
    if problem:
        pytest.fail(problem, pytrace=False)


def part_of(digest_key: str) -> str:
    family, dtype = digest_key.split("/")[:2]
    return "quant" if family == "quant" else f"{family}/{dtype}"


# qwen2 in fp32 (with the engine's digest) first: the fast tier runs it, the heavy tier the rest.
PARTS = ["qwen2/fp32"] + [f"{family}/{dtype}" for family in golden.FAMILY_NAMES for dtype in golden.DTYPES
                          if (family, dtype) != ("qwen2", "fp32")] + ["quant"]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("part", PARTS)
def test_cpu_digests_equal_golden(part):
    """Every family, bf16 and fp32, alone and in three batchings, the engine, and the quantized
    formats: the CPU interpreter's bits are those recorded (one part per test)."""
    _check("cpu", part)


def test_the_parts_cover_every_recorded_digest():
    recorded = golden.load()["cpu-interpreter"]["digests"]
    assert {part_of(k) for k in recorded} == set(PARTS)


@pytest.mark.gpu
def test_cuda_digests_equal_golden():
    """This GPU and toolchain's bits are those recorded; a GPU with no entry fails and says how
    to record one."""
    _check("cuda")


def test_a_changed_reduction_order_moves_digests(monkeypatch):
    """Negative control: projections whose BLOCK_K follows M (BLOCK_K 16 for M <= 4, else the
    fixed 64) change the bits of the short samples run alone, and the check names them."""
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
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
