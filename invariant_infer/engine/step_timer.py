"""Wall time per phase of engine steps, for the host-overhead benchmark.

Off by default (``EngineCore.timer`` is ``NULL_TIMER``, whose marks do nothing). On, each phase
boundary reads ``time.perf_counter`` and, on CUDA, first waits for the device, so that queued
kernels are charged to the phase that launched them (this serializes the step; timed steps run
slower than untimed ones). Host phases: schedule, metadata, sampling, output;
device phases: forward (the model, lm_head and the greedy rows' argmax) and logprobs (the
token-logprob kernel)."""
from __future__ import annotations

import statistics
import time

import torch

HOST_PHASES = ("schedule", "metadata", "sampling", "output")
DEVICE_PHASES = ("forward", "logprobs")
PHASES = HOST_PHASES + DEVICE_PHASES


class StepTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.samples: dict[str, list[float]] = {phase: [] for phase in PHASES}  # seconds, one per step
        self._step = dict.fromkeys(PHASES, 0.0)
        self._last = 0.0

    @property
    def steps(self) -> int:
        return len(self.samples[PHASES[0]])

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._step = dict.fromkeys(PHASES, 0.0)
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """Charge the time since the last mark to ``phase``."""
        now = self._now()
        self._step[phase] += now - self._last
        self._last = now

    def end_step(self, phase: str) -> None:
        self.mark(phase)
        for name, seconds in self._step.items():
            self.samples[name].append(seconds)

    def per_step_us(self) -> dict[str, float]:
        """Median microseconds per step, per phase (a median: one garbage-collector pause or
        preemption by the OS does not move it)."""
        return {phase: 1e6 * statistics.median(values) if values else 0.0 for phase, values in self.samples.items()}


class NullTimer:
    """A timer that is off: every mark does nothing, so the step marks its phases unconditionally."""

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def end_step(self, phase: str) -> None:
        pass


NULL_TIMER = NullTimer()
