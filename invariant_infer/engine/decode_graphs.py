"""CUDA-graph decode: one captured forward per decode bucket, replayed for every later decode step
of that bucket, so a step costs one graph launch instead of a launch per kernel.

A decode-only step padded to bucket B (``ModelRunner.bucket``) has fixed shapes: B tokens of B
sequences, every KV cache group's block table at its full width, ``max_query_len`` 1 and
``max_seq_len`` the longest context the tables hold. Its forward reads only the runner's persistent
buffers (token ids, positions on each rope axis, slots, query starts, context lengths, block
tables, the Gated DeltaNet slots) and host ints fixed by B, and makes no host sync, so one capture
holds for every step of that bucket: the runner copies each step's metadata into the buffers, then
replays. A step with embedding overrides (a prompt's image rows in a one-token chunk) runs eager:
the graph embeds token ids.

Bits: a replay runs the kernels an eager step of the same bucket runs, with the same configs. The
wider block table and the larger ``max_seq_len`` only add KV-chunk programs that hold no key of the
sequence (the split-KV grid is a schedule; the reduction tree is fixed by each sequence's own
keys), and padding rows compute alone on scratch pages, so each real row is bitwise the unpadded
eager step's.

The capture is a function of the forward (``capture_cuda_graph`` on CUDA), so a test on CPU can
pass one that replays by running the captured closure again: it reads the same objects the graph
would, which checks that nothing a step sets escapes the persistent buffers.
"""
from __future__ import annotations

from typing import Callable

import torch

Forward = Callable[[], torch.Tensor]
Capture = Callable[[Forward], Forward]


def capture_cuda_graph(forward: Forward, pool=None) -> Forward:
    """Run ``forward`` once on a side stream (compiles the kernels, allocates what they keep), capture
    it in a ``torch.cuda.CUDAGraph`` sharing ``pool``, and return its replay: a function that
    replays the graph and returns the captured output tensor (overwritten by each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (a server's vision tower, its tokenizer) cannot
    # invalidate the capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay


class DecodeGraphs:
    """The captured decode forwards of one model runner, one per bucket, captured on first use."""

    def __init__(self, capture: Capture | None = None):
        """``capture``: forward -> replay; by default CUDA graphs in one memory pool shared by the buckets."""
        if capture is None:
            pool = torch.cuda.graph_pool_handle()

            def capture(forward: Forward) -> Forward:
                return capture_cuda_graph(forward, pool)
        self._capture = capture
        self._replays: dict[int, Forward] = {}
        self.num_replays = 0  # decode steps replayed, since start

    def __contains__(self, bucket: int) -> bool:
        return bucket in self._replays

    @property
    def buckets(self) -> list[int]:
        """The buckets captured so far."""
        return sorted(self._replays)

    @torch.inference_mode()
    def capture(self, bucket: int, forward: Forward) -> None:
        self._replays[bucket] = self._capture(forward)

    @torch.inference_mode()
    def replay(self, bucket: int) -> torch.Tensor:
        """The bucket's captured output [B, H] after one replay (valid until the next replay)."""
        self.num_replays += 1
        return self._replays[bucket]()


def cuda_graphs_refusal(device: torch.device, *, invariant: bool, tensor_parallel_size: int,
                        max_loras: int) -> str | None:
    """Why an engine's decode steps cannot replay CUDA graphs, or None when they can."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the model is on {device.type}"
    if not invariant:
        return "kernels='stock' attends sequence by sequence from host lists, which a graph cannot replay"
    if tensor_parallel_size > 1:
        return "under tensor parallelism each rank's step arrives by message; no rank captures graphs"
    if max_loras:
        return "LoRA adapter slots pick their rows per step; run with max_loras=0 to capture graphs"
    return None


def rerun_capture(forward: Forward) -> Forward:
    """A capture for CPU tests: replaying runs the captured closure again, over the objects it
    captured (what a graph replays), instead of a graph."""
    return forward


def default_decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's capture sizes up to ``max_num_seqs``: 1, 2, 4, then every multiple of 8."""
    sizes = [1, 2, 4] + list(range(8, max_num_seqs + 8, 8))
    return tuple(s for s in sizes if s < max_num_seqs) + (max_num_seqs,)
