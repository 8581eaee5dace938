"""Compile kernel variants for NVIDIA GPUs on a machine without one, and read what each needs.

Triton's CUDA backend compiles to PTX and runs its bundled ptxas to a cubin with no GPU present:
``compile_kernel`` does that for one kernel, with the compile options every launch pins
(``launch.PINNED_OPTIONS``). ``compile_report`` compiles a recorded ``KernelVariant``
(``launch_recording``) for one architecture and returns its shared memory (the compiled kernel's
``metadata.shared``), registers and spills (ptxas's own ``-v`` log: Triton fills ``n_regs`` and
``n_spills`` only when it loads a binary on a GPU) and any compile error; ``compile_reports`` runs
many in worker processes. A compile error, or shared memory over ``SHARED_MEMORY_LIMITS[arch]``,
is a variant a GPU of that architecture could not launch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
import multiprocessing

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from .errors import InvalidArgumentError
from .launch import PINNED_OPTIONS
from .launch_recording import KernelVariant

ARCHS = (80, 89, 90)
# Shared memory one block may use (opt-in maximum), in bytes: A100 (sm_80) 163 KiB, L4/L40/RTX 4090
# (sm_89) 99 KiB, H100/H200 (sm_90) 227 KiB.
SHARED_MEMORY_LIMITS = {80: 166912, 89: 101376, 90: 232448}
# Without fp8, Triton lowers a kernel to the same IR for sm_89 as for sm_80 (Ampere's MMA and
# pipelining: fp8 conversions are what sm_89 adds), and a block's shared memory is Triton's own
# allocation, not ptxas's: an sm_80 report of such a variant stands for sm_89 (``as_arch``).
SAME_IR_AS = {89: 80}
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_kernel(kernel, arch: int, signature: dict, constexprs: dict, attrs: dict | None = None,
                   options: dict | None = None, pinned: dict | None = None):
    """``kernel`` compiled for sm_<arch>: Triton's ``CompiledKernel`` (``asm``: ttgir, ptx, cubin;
    ``metadata``). ``signature``, ``constexprs`` and ``attrs`` as ``triton.compiler.ASTSource``
    takes them; ``options`` the launch options; ``pinned`` replaces the pinned compile options."""
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs or {})
    pinned = PINNED_OPTIONS if pinned is None else pinned
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={**(options or {}), **pinned})


def compile_variant(variant: KernelVariant, arch: int):
    backend = make_backend(GPUTarget("cuda", arch, 32))
    attrs = {path: backend.parse_attr(desc) for path, desc in variant.attrs}
    return compile_kernel(variant.kernel, arch, dict(variant.signature), dict(variant.constexprs), attrs,
                          dict(variant.options))


@dataclass(frozen=True)
class CompileReport:
    variant: KernelVariant
    arch: int
    shared: int | None = None        # bytes of shared memory per block
    registers: int | None = None     # per thread
    spill_stores: int | None = None  # bytes per thread
    spill_loads: int | None = None
    seconds: float = 0.0             # CPU time of the compile, ptxas included
    error: str | None = None

    @property
    def problem(self) -> str | None:
        """Why a GPU of this architecture could not launch the variant (None when it could)."""
        if self.error:
            return f"sm_{self.arch}: {self.variant.label()} does not compile: {self.error}"
        if self.shared > SHARED_MEMORY_LIMITS[self.arch]:
            return (f"sm_{self.arch}: {self.variant.label()} needs {self.shared} bytes of shared memory, over the "
                    f"{SHARED_MEMORY_LIMITS[self.arch]} a block may use")
        return None


def compile_report(variant: KernelVariant, arch: int) -> CompileReport:
    """Compile ``variant`` for sm_<arch> (never from Triton's cache: ptxas must run to log its usage)."""
    knobs = triton.knobs
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    log = io.StringIO()
    start = _cpu_seconds()
    try:
        with contextlib.redirect_stdout(log):
            compiled = compile_variant(variant, arch)
    except Exception as error:  # noqa: BLE001  (the report carries any compile failure)
        cause = error
        while cause.__cause__ is not None:  # Triton wraps the error in the kernel's source: name the cause
            cause = cause.__cause__
        message = " ".join(str(cause).split())
        return CompileReport(variant, arch, seconds=_cpu_seconds() - start,
                             error=f"{type(cause).__name__}: {message[-1000:]}")
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    text = log.getvalue()
    registers = _REGISTERS.search(text)
    spills = _SPILLS.search(text)
    return CompileReport(variant, arch, shared=compiled.metadata.shared,
                         registers=int(registers.group(1)) if registers else None,
                         spill_stores=int(spills.group(1)) if spills else None,
                         spill_loads=int(spills.group(2)) if spills else None,
                         seconds=_cpu_seconds() - start)


def as_arch(report: CompileReport, arch: int) -> CompileReport:
    """``report`` (for sm_<SAME_IR_AS[arch]>) read for sm_<arch>: its shared memory checked against
    that architecture's limit, its compile error named for it."""
    if SAME_IR_AS.get(arch) != report.arch:
        raise InvalidArgumentError(f"an sm_{report.arch} report does not stand for sm_{arch}")
    return dataclasses.replace(report, arch=arch)


def _cpu_seconds() -> float:
    times = os.times()  # this process and its finished children (ptxas)
    return times.user + times.system + times.children_user + times.children_system


def _report_job(job: tuple[KernelVariant, int]) -> CompileReport:
    return compile_report(*job)


def compile_reports(variants, archs=ARCHS, workers: int | None = None) -> list[CompileReport]:
    """Every variant compiled for every arch, in ``workers`` processes (default: the CPU count),
    with a fresh Triton cache; the slowest compiles start first. Reports in (variant, arch) order."""
    jobs = [(variant, arch) for variant in variants for arch in archs]
    workers = workers or os.cpu_count() or 1
    # The GDN scan and attention backward compile longest: start the dot-heavy kernels first.
    order = sorted(range(len(jobs)), key=lambda i: -_expected_cost(jobs[i][0]))
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            if workers == 1:
                done = [_report_job(jobs[i]) for i in order]
            else:
                context = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(workers, mp_context=context) as pool:
                    done = list(pool.map(_report_job, [jobs[i] for i in order]))
        finally:
            if env is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = env
    reports = [None] * len(jobs)
    for i, report in zip(order, done):
        reports[i] = report
    return reports


def _expected_cost(variant: KernelVariant) -> int:
    return {"_chunk_gated_delta_rule_kernel": 4, "_attention_dkdv_kernel": 3, "_attention_dq_kernel": 3}.get(
        variant.name, 2 if "attention" in variant.name else 1)
