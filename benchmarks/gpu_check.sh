#!/usr/bin/env bash
# One-shot GPU check: GPU-marked tests, then the full benchmark suite under a time budget.
# Everything lands in one folder: $OUT if set, else benchmarks/results/<date>-<gpu>/.
# Sized for < 8 minutes on one H200. Env overrides: PYTHON, TOTAL_S (default 450),
# TEST_TIMEOUT_S (180), SUITE_MAX_S (300), BENCH_COMMIT (commit id when .git is absent),
# SUITE_ARGS (extra arguments for python -m benchmarks, e.g. "--quick" for a dry run on CPU).
set -u -o pipefail
START=$(date +%s)
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-450}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-180}
SUITE_MAX_S=${SUITE_MAX_S:-300}
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1

GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9.\n-' '-')
DEST=${OUT:-benchmarks/results/$(date +%Y%m%d-%H%M%S)-${GPU:-gpu}}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
echo "[gpu_check] writing to $DEST"

# -- make invariant_infer.kernels importable (it lives in kernels/, mapped by the package build) --
INSTALL_RC=0
if ! $PY -c "import invariant_infer.kernels" >/dev/null 2>&1; then
  $PY -m pip install --no-deps --no-build-isolation -e . >"$DEST/install.log" 2>&1
  INSTALL_RC=$?
fi
if ! $PY -c "import invariant_infer.kernels" >/dev/null 2>&1; then
  # Fallback without pip: a sitecustomize that maps invariant_infer.kernels to kernels/.
  SHIM=$(mktemp -d)
  cat >"$SHIM/sitecustomize.py" <<PYEOF
import importlib.util, os, sys
class _KernelsFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "invariant_infer.kernels":
            return None
        root = os.path.join("$ROOT", "kernels")
        return importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
sys.meta_path.append(_KernelsFinder)
PYEOF
  export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  echo "[gpu_check] pip install -e failed (rc $INSTALL_RC); using the import shim in $SHIM" | tee -a "$DEST/install.log"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# -- provenance ------------------------------------------------------------------------------------
{
  COMMIT=$(git rev-parse HEAD 2>/dev/null) && { git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT-dirty"; }
  echo "commit: ${COMMIT:-${BENCH_COMMIT:-unknown}}"
  echo "date: $(date -Iseconds)"
  echo "host: $(hostname)"
  $PY - <<'PYEOF' 2>&1
import platform, torch, triton, transformers
print(f"python: {platform.python_version()}\ntorch: {torch.__version__}\ntriton: {triton.__version__}\n"
      f"transformers: {transformers.__version__}\ncuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"gpu: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
PYEOF
} >"$DEST/commit.txt"
nvidia-smi >"$DEST/nvidia-smi.txt" 2>&1
cat "$DEST/commit.txt"

# -- 1. GPU-marked tests -------------------------------------------------------------------------
echo "[gpu_check] pytest -m gpu (timeout ${TEST_TIMEOUT_S}s)"
timeout -k 10 "$TEST_TIMEOUT_S" $PY -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$DEST/pytest.log"
TESTS_RC=$?

# -- 2. full suite, with what is left of the time budget ------------------------------------------
ELAPSED=$(( $(date +%s) - START ))
BUDGET=$(( TOTAL_S - ELAPSED - 60 ))
(( BUDGET > SUITE_MAX_S )) && BUDGET=$SUITE_MAX_S
(( BUDGET < 60 )) && BUDGET=60
echo "[gpu_check] benchmark suite, budget ${BUDGET}s (${ELAPSED}s elapsed)"
timeout -k 10 $(( BUDGET + 60 )) $PY -m benchmarks --out "$DEST" --budget-s "$BUDGET" ${SUITE_ARGS:-} 2>&1 | tee "$DEST/suite.log"
SUITE_RC=$?

# -- 3. exit codes and the summary, last -------------------------------------------------------------
TOTAL=$(( $(date +%s) - START ))
printf 'install_rc=%s\ntests_rc=%s\nsuite_rc=%s\ntotal_s=%s\n' "$INSTALL_RC" "$TESTS_RC" "$SUITE_RC" "$TOTAL" \
  | tee "$DEST/exit_codes.txt"
echo "================ summary ($DEST) ================"
grep -E "passed|failed|error|skipped" "$DEST/pytest.log" | tail -1
if [ -f "$DEST/results.json" ]; then
  $PY -m benchmarks.report --summary "$DEST/results.json"
else
  echo "no results.json (suite rc $SUITE_RC); see $DEST/suite.log"
fi
echo "tests rc $TESTS_RC, suite rc $SUITE_RC, ${TOTAL}s"
exit $(( TESTS_RC != 0 || SUITE_RC != 0 ))
