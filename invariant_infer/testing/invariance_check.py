"""The check ``invariant-infer check`` runs, and ``serve`` before it takes traffic: is this model,
as loaded here, batch-invariant?

At the model's real widths, on a few short rows of random token ids (lengths ``PROBE_LENGTHS``):
  * the audit (``invariant_infer.model.audit``): one forward, every floating-point reduction on an
    invariant kernel;
  * each row alone against the same row in a left-padded batch of all of them, then in a
    right-padded one;
  * a decode step (the longest row's last token, with the KV cache of its prefill) against the same
    position of the prefill of the whole row.
Every comparison is ``torch.equal`` on logits rows. ``environment`` describes what the bits depend
on besides the model: the device, the library versions and the pinned compile options."""
from __future__ import annotations

import importlib.metadata
import inspect
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import transformers
import triton

from ..errors import UnsupportedModelError, UnsupportedOperationError
from ..kernels.launch import DOT_PRECISION, PINNED_OPTIONS, pinning_problem
from ..model.audit import audit
from ..model.families import text_config
from .drift import batch_drift, logits_alone

PROBE_LENGTHS = (5, 1, 9, 3)


@dataclass
class CheckResult:
    key: str                           # short: "audit", "left padding", "right padding", "decode"
    name: str                          # what was compared
    passed: bool
    max_abs_diff: float | None = None  # max |Δ logit| of a failed comparison
    details: list[str] = field(default_factory=list)  # what failed: stray ops, mismatching rows, an error

    def __str__(self) -> str:
        if self.passed:
            return f"PASS  {self.name}"
        delta = f" (max |Δ| {self.max_abs_diff:.6g})" if self.max_abs_diff is not None else ""
        return "\n      ".join([f"FAIL  {self.name}{delta}", *self.details])


@dataclass
class CheckReport:
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(result.passed for result in self.results)

    @property
    def failed(self) -> list[str]:
        """The failed checks' keys."""
        return [result.key for result in self.results if not result.passed]

    def __str__(self) -> str:
        return "\n".join(map(str, self.results))


def environment(device: torch.device) -> list[str]:
    """Lines naming the device, the library versions and the compile options the kernels pin."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        where = f"cuda:{index} {torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"
    else:
        where = "cpu (the Triton kernels run through the interpreter)"
    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "transformers": transformers.__version__, "invariant-infer": _own_version()}
    options = ", ".join(f"{name}={value!r}" for name, value in PINNED_OPTIONS.items())
    lines = [f"device:          {where}",
             "versions:        " + ", ".join(f"{name} {version}" for name, version in versions.items()),
             f"compile options: {options}; tl.dot input_precision={DOT_PRECISION!r}"]
    problem = pinning_problem(traced=False)
    if problem:
        lines.append(f"                 the pin does not hold here: {problem}")
    return lines


def _own_version() -> str:
    try:
        return importlib.metadata.version("invariant-infer")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def check_invariance(model, *, seed: int = 0, lengths: Sequence[int] = PROBE_LENGTHS,
                     on_result: Callable[[CheckResult], None] | None = None) -> CheckReport:
    """Run the audit and the probes on ``model`` (as it will run: ``make_invariant`` already applied),
    each result passed to ``on_result`` as it comes. Nothing of the model changes."""
    samples = probe_rows(model, lengths, seed)
    alone: list[torch.Tensor] = []
    shown = ", ".join(map(str, lengths))
    checks = [("audit", "audit: every reduction of a forward runs on an invariant kernel", lambda: _audit(model)),
              ("left padding", f"rows of {shown} tokens alone == in a left-padded batch",
               lambda: _in_batch(model, samples, "left", alone)),
              ("right padding", f"rows of {shown} tokens alone == in a right-padded batch",
               lambda: _in_batch(model, samples, "right", alone)),
              ("decode", f"decode step with the KV cache == the same position of the prefill ({max(lengths)} tokens)",
               lambda: _decode(model, max(samples, key=len)))]
    return run_checks(checks, on_result)


# Raised through the checks: the model is refused here, which the commands report as a refusal.
REFUSALS = (UnsupportedOperationError, UnsupportedModelError)


def run_checks(checks, on_result: Callable[[CheckResult], None] | None = None) -> CheckReport:
    """Run each ``(key, name, run)`` check in turn (``run()`` returns ``(passed, max_abs_diff, details)``),
    reporting each result as it comes; a check that raises is a failed check naming the exception."""
    report = CheckReport()
    for key, name, run in checks:
        try:
            result = CheckResult(key, name, *run())
        except REFUSALS:  # a refusal by name (FP8 on a GPU that has none) is not a batch-variant result
            raise
        except Exception as exc:  # noqa: BLE001  (a check that cannot run is a failed check, named)
            result = CheckResult(key, name, False, details=[f"{type(exc).__name__}: {exc}"])
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    return report


def probe_rows(model, lengths: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Rows of random token ids of ``lengths``, avoiding the config's special ids (an image token with
    no image is refused)."""
    config = text_config(model.config)
    special = {value for source in (model.config, config) for key, value in vars(source).items()
               if key.endswith(("_token_id", "_token_index")) and isinstance(value, int)}
    pool = torch.tensor([i for i in range(min(config.vocab_size, 1 << 16)) if i not in special])
    generator = torch.Generator().manual_seed(seed)
    return [pool[torch.randint(0, len(pool), (n,), generator=generator)] for n in lengths]


# Each check returns (passed, max |Δ logit| when a comparison failed, details).

def _audit(model) -> tuple:
    found = audit(model)
    return found.ok, None, [f"stray op {op} in {module or '<model>'}" for module, op in found.stray]


def _in_batch(model, samples, side: str, alone: list) -> tuple:
    if len(alone) != len(samples):  # computed once, for both paddings
        alone[:] = (logits_alone(model, sample) for sample in samples)
    drift = batch_drift(model, samples, side=side, alone=alone)
    return (drift.rows_unequal == 0, drift.max_abs_diff if drift.rows_unequal else None,
            [f"row {row} (length {len(samples[row])}): max |Δ| {diff:.6g}" for row, diff in drift.mismatches])


@torch.no_grad()
def _decode(model, sample: torch.Tensor) -> tuple:
    device = next(model.parameters()).device
    ids = sample.to(device)[None]
    whole = logits_alone(model, sample)[-1]
    cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    prefill = model(input_ids=ids[:, :-1], use_cache=True)
    cache = getattr(prefill, "cache", None) or prefill.past_key_values
    step = model(input_ids=ids[:, -1:], use_cache=True, **{cache_keyword: cache}).logits[0, -1]
    if torch.equal(step, whole):
        return True, None, []
    return False, (step.float() - whole.float()).abs().max().item(), []

