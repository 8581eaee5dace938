"""The GPU check's ``invariant-infer check`` section: a random-init checkpoint of a preset, written
with ``save_pretrained`` to a temporary folder, then ``python -m invariant_infer.cli check`` on it,
as a user would run it on a real checkpoint.

    python -m benchmarks.gpu_check_model_check [--device cuda|cpu] [--preset FAMILY:PRESET] [--dtype bf16]

Default preset: Qwen2.5-1.5B's widths on GPU, the family's ``tiny`` preset on CPU (the dry run).
Exit status: the check command's (1 for a failure of its own that would read as the runner's
protocol statuses). Record: ``preset``, ``checkpoint_s``, ``check_rc``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_PRESET = {"cuda": "qwen2:qwen2.5-1.5b", "cpu": "qwen2:tiny"}
RESERVED = (77, 124)  # the runner's NOT_APPLICABLE and OUT_OF_TIME


def write_checkpoint(family: str, preset: str, device: str, path: Path) -> Path:
    """Random weights drawn on ``device`` (no fp32 detour through the host at 1.5B), saved in bf16."""
    import torch

    from invariant_infer.testing.random_checkpoints import random_config, random_model

    with torch.device(device):
        model = random_model(random_config(family, preset), seed=0, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


def check_argv(model: Path, device: str, dtype: str) -> list[str]:
    return [sys.executable, "-m", "invariant_infer.cli", "check", "--model", str(model), "--device", device,
            "--dtype", dtype]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_model_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--preset", default=None, help="FAMILY:PRESET (default: qwen2:qwen2.5-1.5b on cuda, "
                                                       "qwen2:tiny on cpu)")
    parser.add_argument("--dtype", default="bf16", help="as the check command takes it (bf16, fp16, fp32)")
    args = parser.parse_args(argv)
    preset = args.preset or DEFAULT_PRESET[args.device]
    family, _, name = preset.partition(":")
    record = {"preset": preset}
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as tmp:
        t0 = time.monotonic()
        write_checkpoint(family, name, args.device, Path(tmp) / "model")
        record["checkpoint_s"] = round(time.monotonic() - t0, 1)
        print(f"[check] wrote a random {preset} checkpoint in {record['checkpoint_s']} s; running "
              f"{' '.join(check_argv(Path('DIR'), args.device, args.dtype)[1:])}", flush=True)
        rc = subprocess.run(check_argv(Path(tmp) / "model", args.device, args.dtype)).returncode
    record["check_rc"] = rc
    out = os.environ.get("GPU_CHECK_RECORD")
    if out:
        Path(out).write_text(json.dumps(record) + "\n")
    return 1 if rc in RESERVED else rc


if __name__ == "__main__":
    sys.exit(main())
