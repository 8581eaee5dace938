"""Shared fixtures: random-init checkpoints of every supported family, written with save_pretrained
and loaded back with from_pretrained, the way users load real ones. Session-scoped: each is written
once per pytest-xdist worker and reused by every test file that worker runs (loading one back takes
about 20 ms). GPU-marked tests skip without CUDA."""
from __future__ import annotations

import pytest
import torch

from helpers.models import FAMILY_NAMES
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config, save_random_checkpoint


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the heavy marks added here
def pytest_collection_modifyitems(config, items):
    mark_cells_beyond_the_fast_cover_heavy(items, some_cells_named=any("::" in arg for arg in config.args))
    run_longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run benchmarks/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def mark_cells_beyond_the_fast_cover_heavy(items, some_cells_named: bool = False) -> None:
    """A test marked ``fast_cells(n)`` keeps n of its parametrizations in the fast tier, picked one by
    one to cover as many parameter values not yet covered as they can (ties: collection order), or
    those named by ``fast_cells(ids=[...])``; the others get the ``heavy`` mark. ``some_cells_named``:
    the command line named test cells (``file::test[id]``), so a named fast id may not be collected."""
    groups: dict = {}
    for item in items:
        marker = item.get_closest_marker("fast_cells")
        if marker is not None and hasattr(item, "callspec"):
            groups.setdefault((item.module.__name__, item.originalname), (marker, []))[1].append(item)
    for marker, group in groups.values():
        # GPU cells are left as they are: skipped without CUDA, run by the GPU check
        group = [item for item in group if item.get_closest_marker("heavy") is None and "gpu" not in item.keywords]
        if not group:
            continue
        if "ids" in marker.kwargs:
            kept = [item for item in group if item.callspec.id in marker.kwargs["ids"]]
            assert some_cells_named or len(kept) == len(marker.kwargs["ids"]), \
                f"fast_cells ids not all found: {marker.kwargs['ids']}"
            for item in group:
                if item not in kept:
                    item.add_marker(pytest.mark.heavy)
            continue
        covered: set = set()
        kept = []
        for _ in range(min(marker.args[0], len(group))):
            best = max((item for item in group if item not in kept),
                       key=lambda item: len(set(cell_values(item)) - covered))  # max keeps the first of ties
            kept.append(best)
            covered |= set(cell_values(best))
        for item in group:
            if item not in kept:
                item.add_marker(pytest.mark.heavy)


def cell_values(item) -> list[tuple[str, str]]:
    return [(name, repr(value)) for name, value in item.callspec.params.items()]


def file_minutes(item) -> float:
    marker = item.module.pytestmark if hasattr(item.module, "pytestmark") else []
    for mark in marker if isinstance(marker, list) else [marker]:
        if mark.name == "file_minutes":
            return float(mark.args[0])
    return 0.0


def run_longest_files_first(items) -> None:
    """Files marked ``fresh_worker`` go first (a fork of a worker that has grown through other files can
    fail for memory: ENOMEM, with no swap); then files marked ``file_minutes(N)``, longest first; the
    rest keep their order. With ``--dist loadfile --no-loadscope-reorder`` each worker then starts on
    one of those files and the short ones fill in around them (longest-processing-time-first scheduling)."""
    # a stable sort: same-length files keep their order
    items.sort(key=lambda item: (item.get_closest_marker("fresh_worker") is None, -file_minutes(item)))


@pytest.fixture(autouse=True)
def _seed():
    """Every test draws the same random data on every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """2 layers, hidden 64, 4 query heads / 2 KV heads of 16, q/k/v bias, untied lm_head."""
    return save_random_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), qwen2_config("tiny"), seed=0)


@pytest.fixture(scope="session")
def tied_checkpoint(tmp_path_factory):
    """Like tiny, with lm_head tied to the embeddings (as Qwen2.5-1.5B)."""
    config = qwen2_config("tiny", tie_word_embeddings=True, num_hidden_layers=1)
    return save_random_checkpoint(tmp_path_factory.mktemp("tied-qwen2"), config, seed=1)


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """family -> the path of its "tiny" random checkpoint, written on first use."""
    paths = {}

    def get(family: str):
        if family not in paths:
            paths[family] = save_random_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"),
                                                   random_config(family, "tiny"), seed=0)
        return paths[family]
    return get


@pytest.fixture(params=FAMILY_NAMES)
def family_checkpoint(request, family_checkpoints):
    """Each family's tiny checkpoint in turn (qwen3: head_dim != hidden / heads, tied; llama: llama3
    RoPE, attention and MLP biases, tied; mistral: no sliding window, 4 query heads per KV head)."""
    return family_checkpoints(request.param)
