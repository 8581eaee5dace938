"""Wall time per phase of engine steps, for the host-overhead benchmark.

Off by default (``Engine.timer`` is None): the step then only tests that attribute at each phase
boundary. On, each boundary reads ``time.perf_counter`` and, on CUDA, first waits for the device,
so that queued kernels are charged to the phase that launched them (this serializes the step;
timed steps run slower than untimed ones). Host phases: schedule, metadata, sampling, output;
device phases: forward (the model and lm_head) and logprobs (the token-logprob kernel)."""
from __future__ import annotations

import time

import torch

HOST_PHASES = ("schedule", "metadata", "sampling", "output")
DEVICE_PHASES = ("forward", "logprobs")
PHASES = HOST_PHASES + DEVICE_PHASES


class StepTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.totals = dict.fromkeys(PHASES, 0.0)   # seconds
        self.steps = 0
        self._last = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """Charge the time since the last mark to ``phase``."""
        now = self._now()
        self.totals[phase] += now - self._last
        self._last = now

    def end_step(self, phase: str) -> None:
        self.mark(phase)
        self.steps += 1

    def per_step_us(self) -> dict[str, float]:
        """Mean microseconds per step, per phase."""
        return {phase: 1e6 * total / max(self.steps, 1) for phase, total in self.totals.items()}
