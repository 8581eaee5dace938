"""The GPU check's first section, seconds long: the package imports, this Triton accepts the pinned
compile options, and the linear and the attention kernels give a row alone the bits of its row in a
batch of 64 (``torch.equal``), in bf16 (the models' dtype) and fp32 (whose 24-bit mantissa shows a
changed summation order that bf16's rounding often hides).

    python -m benchmarks.gpu_check_smoke [--device cuda|cpu]

On CPU (the dry run) the same launches run through the Triton interpreter at tiny shapes. Exit
status 0 when every check holds; each check's outcome goes to the section's record
(``GPU_CHECK_RECORD``) and to stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

BATCH = 64
# (hidden, N) of the linear and (query heads, KV heads, head_dim, tokens) of the attention: on GPU
# Qwen2.5-1.5B's widths; on CPU tiny ones the interpreter runs in a second or two.
# On CPU the keys span more than one KV block of the attention's smaller configs.
SHAPES = {"cuda": {"linear": (1536, 8960), "attention": (12, 2, 128, 512)},
          "cpu": {"linear": (256, 96), "attention": (1, 1, 16, 40)}}
DTYPES = ("bf16", "fp32")


def pinned_options_problem() -> str | None:
    """None when every pinned compile option is a field of this Triton's CUDA backend options;
    otherwise which are not (a launch would pass them to a compiler that does not know them)."""
    from triton.backends.nvidia.compiler import CUDAOptions

    from invariant_infer.kernels.launch import PINNED_OPTIONS

    known = {f.name for f in dataclasses.fields(CUDAOptions)}
    unknown = sorted(set(PINNED_OPTIONS) - known)
    return f"not options of this Triton's CUDAOptions: {unknown}" if unknown else None


def _dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def linear_row_alone_equal(device, shape, dtype: str = "bf16") -> bool:
    """Row 5 alone against row 5 of the same 64-row product."""
    import torch

    from invariant_infer import kernels

    k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(BATCH, k, generator=gen, device=device).to(_dtype(dtype))
    w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(_dtype(dtype))
    b = (torch.randn(n, generator=gen, device=device) * 0.02).to(_dtype(dtype))
    linear = kernels.linear
    batched, alone = linear(x, w, b), linear(x[5:6].clone(), w, b)
    return bool(torch.equal(alone[0], batched[5]))


def attention_row_alone_equal(device, shape, dtype: str = "bf16") -> bool:
    """Sequence 3 alone against sequence 3 in a batch of 64 left-padded sequences of other lengths."""
    import torch

    from invariant_infer import kernels

    hq, hkv, d, length = shape
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(BATCH, hq, length, d, generator=gen, device=device).to(_dtype(dtype))
    k = torch.randn(BATCH, hkv, length, d, generator=gen, device=device).to(_dtype(dtype))
    v = torch.randn(BATCH, hkv, length, d, generator=gen, device=device).to(_dtype(dtype))
    attention = kernels.attention
    i32 = dict(device=device, dtype=torch.int32)
    pads = torch.tensor([(7 * i) % (length // 2 + 1) for i in range(BATCH)], **i32)
    ends, q_start = torch.full((BATCH,), length, **i32), torch.zeros(BATCH, **i32)
    scale = d ** -0.5
    batched = attention(q, k, v, pads, ends, q_start, scale)
    row = slice(3, 4)
    alone = attention(q[row].clone(), k[row].clone(), v[row].clone(), pads[row].clone(), ends[row].clone(),
                      q_start[row].clone(), scale)
    real = slice(int(pads[3]), length)  # padded query rows are not compared
    return bool(torch.equal(alone[0, real], batched[3, real]))


CHECKS = {"linear": linear_row_alone_equal, "attention": attention_row_alone_equal}


def run(device_name: str) -> dict:
    started = time.monotonic()
    record = {"device": device_name}
    import torch
    import triton

    import invariant_infer  # noqa: F401  (the package imports)

    record.update(torch=torch.__version__, triton=triton.__version__, import_s=round(time.monotonic() - started, 1))
    if device_name == "cuda":
        if not torch.cuda.is_available():
            record["reason"] = "no CUDA device is available"
            return record
        record["gpu"] = torch.cuda.get_device_name(0)
    device = torch.device(device_name)
    problem = pinned_options_problem()
    record["pinned_options_accepted"] = problem is None
    if problem:
        record["reason"] = problem
    shapes = SHAPES[device.type]
    for name, check in CHECKS.items():
        for dtype in DTYPES:
            key, t0 = f"{name}_{dtype}", time.monotonic()
            try:
                record[f"{key}_row_alone_equal"] = check(device, shapes[name], dtype)
            except Exception as exc:  # the record says which launch failed and how
                record[f"{key}_row_alone_equal"] = None
                record.setdefault("reason", f"{key} launch: {type(exc).__name__}: {exc}"[:300])
            record[f"{key}_s"] = round(time.monotonic() - t0, 2)
            if record[f"{key}_row_alone_equal"] is False:
                record.setdefault("reason", f"{key}: the row alone differs from its row in the batch of {BATCH}")
    return record


def passed(record: dict) -> bool:
    return bool(record.get("pinned_options_accepted")) and all(
        record.get(f"{name}_{dtype}_row_alone_equal") is True for name in CHECKS for dtype in DTYPES)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    record = run(args.device)
    print(json.dumps(record, indent=1))
    out = os.environ.get("GPU_CHECK_RECORD")
    if out:
        Path(out).write_text(json.dumps(record) + "\n")
    return 0 if passed(record) else 1


if __name__ == "__main__":
    sys.exit(main())
