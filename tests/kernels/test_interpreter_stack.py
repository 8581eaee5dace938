"""A call through ``call_on_fresh_chunk`` maps one frame-stack chunk, whatever the caller's depth; a
plain call whose depth swings across a chunk's end maps one per swing (the negative control: CPython
3.11 and later keep frames in chunks)."""
from __future__ import annotations

import resource
import sys

import pytest

from invariant_infer.kernels.interpreter_stack import call_on_fresh_chunk

CALLS = 500  # swings of one frame per hot loop


def leaf(x):
    return x + 1


def hot_loop() -> int:
    total = 0
    for _ in range(CALLS):
        total = leaf(total)
    return total


def page_faults_at_depth(depth: int, run) -> int:
    """Minor page faults of ``run()`` called ``depth`` frames below this one."""
    if depth:
        return page_faults_at_depth(depth - 1, run)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_call_on_a_fresh_chunk_maps_one_chunk_at_any_depth():
    assert call_on_fresh_chunk(hot_loop, (), {}) == CALLS and call_on_fresh_chunk(leaf, (1,), {}) == 2
    faults = [page_faults_at_depth(depth, lambda: call_on_fresh_chunk(hot_loop, (), {})) for depth in range(400)]
    assert max(faults) < CALLS // 10, faults  # measured: at most 10 (the chunk's pages)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="frames live on the heap before CPython 3.11")
def test_negative_control_a_plain_call_maps_a_chunk_per_swing_at_some_depth():
    faults = [page_faults_at_depth(depth, hot_loop) for depth in range(400)]  # 400 frames span two 16 KiB chunks
    assert max(faults) >= CALLS // 2, faults  # measured: 500 at one depth, 0 at the others
