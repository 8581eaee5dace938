"""Timers for CPU and GPU, and the run context (device, mode, time budget, skipped items)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, reps: int = 3, warmup: int = 1, flush_l2: bool = False) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    GPU, flush_l2: ``triton.testing.do_bench`` (it zeroes a 256 MB buffer before every
    repetition, so small weights are not served from L2), median. GPU otherwise: CUDA events
    around each call after ``warmup`` calls, median of ``reps``. CPU: perf_counter, median."""
    if device.type == "cuda":
        if flush_l2:
            from triton.testing import do_bench
            try:
                return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
            except TypeError:  # older triton: no return_mode
                return float(do_bench(fn, warmup=10, rep=40, quantiles=[0.5])[0])
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return float(statistics.median(times))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    """Peak allocated GPU memory since ``reset_peak``; None on CPU (torch's CPU allocator is not
    visible to tracemalloc, and ru_maxrss is a process-lifetime high-water mark)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 1e9
    return None


def free_memory(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


ITEMS = ("all", "headline", "rest")


@dataclass
class Run:
    """What every section gets: where to run, quick or full, which items, and when to stop."""
    device: torch.device
    quick: bool
    deadline: float | None = None  # time.monotonic() value; None = no budget
    skipped: list = field(default_factory=list)  # {"section", "item", "reason"} (+ "error" for a failure)
    section: str = ""
    items: str = "all"  # "headline": the few items the GPU check measures first; "rest": the others

    def grid(self, full, quick, headline=(), quick_headline=()) -> list:
        """A section's items: its full or quick grid ("all"), its headline items ("headline"; a
        section without any has none), or the grid less the headline items ("rest")."""
        grid, head = (list(quick), list(quick_headline)) if self.quick else (list(full), list(headline))
        if self.items == "headline":
            return head
        if self.items == "rest":
            return [item for item in grid if item not in head]
        return grid

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def out_of_time(self, item: str) -> bool:
        """True (and the item recorded as skipped) when this section's budget is spent."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.skipped.append({"section": self.section, "item": item, "reason": "time budget"})
            return True
        return False

    def failed(self, item: str, exc: BaseException) -> None:
        entry = {"section": self.section, "item": item, "reason": f"{type(exc).__name__}: {exc}"[:300],
                 "error": type(exc).__name__}
        if isinstance(exc, ModuleNotFoundError) and exc.name:  # an optional package this item needs
            entry["missing_module"] = exc.name
        self.skipped.append(entry)
        free_memory(self.device)
