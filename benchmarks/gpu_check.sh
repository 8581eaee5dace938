#!/usr/bin/env bash
# One-shot GPU check; the logic is benchmarks/gpu_check.py (sections, outputs, environment: its
# docstring and benchmarks/README.md). `--dry-run`: the same sections on CPU at tiny shapes.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
