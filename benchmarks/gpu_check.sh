#!/usr/bin/env bash
# One-shot GPU check: GPU-marked tests, this GPU's golden digests, tensor parallelism where the machine has two or
# more GPUs (the tensor_parallel benchmark section: TP 1, 2, 4, 8 as the GPUs allow, each checked bitwise against
# TP 1, into tensor-parallel/), then the full benchmark suite (Qwen2.5-1.5B; every section of
# benchmarks.SECTIONS, the serving engine, the HTTP server and speculative decoding (spec: speedup, acceptance,
# bits; its rows printed in the summary) and quantized GEMMs (quant: time ratios to stock FP8 / int4, weight
# bytes, bits; its rows printed in the summary) last, each with its share of the budget) under a time
# budget, then the matmul section at other families' shapes (Qwen3-8B, Llama-3.1-8B).
# Everything lands in one folder: $OUT if set, else benchmarks/results/<date>-<gpu>/; the extra
# presets in sub-folders of it, one per preset (qwen3-8b/, llama-3.1-8b/).
# Sized for < 8 minutes on one H200. Env overrides: PYTHON, TOTAL_S (default 450),
# TEST_TIMEOUT_S (180), GOLDEN_TIMEOUT_S (120), TP_TIMEOUT_S (150), SUITE_MAX_S (300), BENCH_COMMIT (commit id when .git is absent),
# SUITE_ARGS (extra arguments for python -m benchmarks, e.g. "--quick" for a dry run on CPU),
# EXTRA_PRESETS ("qwen3:qwen3-8b llama:llama-3.1-8b"; empty to skip), EXTRA_SECTIONS (matmul),
# EXTRA_S (100: seconds of TOTAL_S kept from the suite for the extra presets), EXTRA_MAX_S (60: the
# most budget one extra preset gets).
set -u -o pipefail
START=$(date +%s)
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-450}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-180}
GOLDEN_TIMEOUT_S=${GOLDEN_TIMEOUT_S:-120}
TP_TIMEOUT_S=${TP_TIMEOUT_S:-150}
SUITE_MAX_S=${SUITE_MAX_S:-300}
EXTRA_PRESETS=${EXTRA_PRESETS-qwen3:qwen3-8b llama:llama-3.1-8b}
EXTRA_SECTIONS=${EXTRA_SECTIONS:-matmul}
EXTRA_S=${EXTRA_S:-100}
EXTRA_MAX_S=${EXTRA_MAX_S:-60}
[ -z "$EXTRA_PRESETS" ] && EXTRA_S=0
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1

GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9.\n-' '-')
DEST=${OUT:-benchmarks/results/$(date +%Y%m%d-%H%M%S)-${GPU:-gpu}}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
echo "[gpu_check] writing to $DEST"

# -- invariant_infer (kernels included) imports from the checkout; no install needed --
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
# Only the files that hold GPU tests: the GPU image lacks the serve, Ray and lm-eval extras that other
# test files import. One process (addopts' two xdist workers are for CPU runs).
GPU_TEST_FILES=$(grep -l -E "mark\.gpu|\bDEVICES\b" tests/test_*.py)
echo "[gpu_check] pytest -m gpu (timeout ${TEST_TIMEOUT_S}s):" $GPU_TEST_FILES
timeout -k 10 "$TEST_TIMEOUT_S" $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" $GPU_TEST_FILES 2>&1 \
    | tee "$DEST/pytest.log"
TESTS_RC=$?

# -- 1b. golden digests of this GPU and toolchain (tests/golden/digests.json; BITS.md) --------------
# Compares them with the committed entry for this backend (rc 1 if any moved or none is recorded) and
# writes this backend's entry to $DEST/golden_digests.json; add it with
# `python -m benchmarks.golden_digests --merge FILE` (and an entry in BITS.md) when it is new or intended.
echo "[gpu_check] golden digests (timeout ${GOLDEN_TIMEOUT_S}s)"
timeout -k 10 "$GOLDEN_TIMEOUT_S" $PY -m benchmarks.golden_digests --device cuda --out "$DEST/golden_digests.json" \
  2>&1 | tee "$DEST/golden_digests.log"
GOLDEN_RC=$?

# -- 1c. tensor parallelism, where the machine has two or more GPUs -------------------------------------
# The suite below leaves the section out: here it runs on every GPU the machine has, or not at all.
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
TP_RC=0
if (( GPUS >= 2 )); then
  echo "[gpu_check] tensor parallelism on $GPUS GPUs (timeout ${TP_TIMEOUT_S}s)"
  timeout -k 10 "$TP_TIMEOUT_S" $PY -m benchmarks --only tensor_parallel --out "$DEST/tensor-parallel" --no-plots \
    2>&1 | tee "$DEST/tensor-parallel.log"
  TP_RC=$?
  $PY - "$DEST/tensor-parallel/results.json" <<'PYEOF' 2>&1 | tee -a "$DEST/tensor-parallel.log"
import json, sys
rows = json.load(open(sys.argv[1]))["tp_steps"]
bad = [r["tp"] for r in rows if not r["bitwise_equal_to_tp1"]]
print(f"[gpu_check] tensor parallelism: TP {[r['tp'] for r in rows]} measured; not bitwise TP 1: {bad}")
sys.exit(1 if bad or len(rows) < 2 else 0)
PYEOF
  (( PIPESTATUS[0] != 0 )) && TP_RC=1
else
  echo "[gpu_check] tensor parallelism: skipped ($GPUS GPU; it needs two or more)"
fi
SUITE_SECTIONS=$($PY -c "from benchmarks import SECTIONS; print(','.join(s for s in SECTIONS if s != 'tensor_parallel'))")

# -- 2. full suite, with what is left of the time budget (less EXTRA_S for step 3) -----------------
ELAPSED=$(( $(date +%s) - START ))
BUDGET=$(( TOTAL_S - ELAPSED - 60 - EXTRA_S ))
(( BUDGET > SUITE_MAX_S )) && BUDGET=$SUITE_MAX_S
(( BUDGET < 60 )) && BUDGET=60
echo "[gpu_check] benchmark suite, budget ${BUDGET}s (${ELAPSED}s elapsed)"
timeout -k 10 $(( BUDGET + 60 )) $PY -m benchmarks --out "$DEST" --budget-s "$BUDGET" --only "$SUITE_SECTIONS" \
  ${SUITE_ARGS:-} 2>&1 | tee "$DEST/suite.log"
SUITE_RC=$?

# -- 3. other families' shapes: EXTRA_SECTIONS per preset, sharing what is left of TOTAL_S ----------
# Each run gets an equal share of the time left: --budget-s of the share less 35 s (at most
# EXTRA_MAX_S), killed 30 s after its budget (imports, the item running when the budget ends, the
# report and plots; a killed run writes nothing, as its one section never ends). A preset whose
# share is under 50 s is skipped. Results: $DEST/<preset>/ (results.json, RESULTS.md, PNGs, suite.log).
EXTRA_RC=0
EXTRA_DIRS=()
read -r -a PRESETS <<<"$EXTRA_PRESETS"
N_PRESETS=${#PRESETS[@]}
for (( i = 0; i < N_PRESETS; i++ )); do
  P=${PRESETS[$i]}
  SUB="$DEST/${P#*:}"
  LEFT=$(( TOTAL_S - ($(date +%s) - START) ))
  SHARE=$(( LEFT / (N_PRESETS - i) ))
  if (( SHARE < 50 )); then
    echo "[gpu_check] $P: skipped, ${SHARE}s left for it (under 50s)"
    continue
  fi
  EXTRA_BUDGET=$(( SHARE - 35 ))
  (( EXTRA_BUDGET > EXTRA_MAX_S )) && EXTRA_BUDGET=$EXTRA_MAX_S
  mkdir -p "$SUB"
  echo "[gpu_check] $P: --only $EXTRA_SECTIONS, budget ${EXTRA_BUDGET}s -> $SUB"
  timeout -k 5 $(( EXTRA_BUDGET + 30 )) $PY -m benchmarks --model-preset "$P" --only "$EXTRA_SECTIONS" \
    --out "$SUB" --budget-s "$EXTRA_BUDGET" ${SUITE_ARGS:-} 2>&1 | tee "$SUB/suite.log"
  RC=$?
  (( RC != 0 )) && EXTRA_RC=$RC
  EXTRA_DIRS+=("$SUB")
done

# -- 4. exit codes and the summary, last -------------------------------------------------------------
TOTAL=$(( $(date +%s) - START ))
printf 'tests_rc=%s\ngolden_rc=%s\ntp_rc=%s\nsuite_rc=%s\nextra_rc=%s\ntotal_s=%s\n' \
  "$TESTS_RC" "$GOLDEN_RC" "$TP_RC" "$SUITE_RC" "$EXTRA_RC" "$TOTAL" | tee "$DEST/exit_codes.txt"
echo "================ summary ($DEST) ================"
grep -E "passed|failed|error|skipped" "$DEST/pytest.log" | tail -1
tail -n 4 "$DEST/golden_digests.log"
for D in "$DEST" ${EXTRA_DIRS[@]+"${EXTRA_DIRS[@]}"}; do
  if [ -f "$D/results.json" ]; then
    $PY -m benchmarks.report --summary "$D/results.json"
    # speculative decoding (the suite's spec section): speedup and bits per workload and batch
    $PY -c "import json,sys; [print('[spec] %(workload)s batch=%(batch)s: %(speedup).2fx, acceptance %(acceptance_length).2f, forwards/token %(forwards_per_token).3f, bitwise_equal=%(bitwise_equal)s' % r) for r in json.load(open(sys.argv[1])).get('spec', []) if r['speculative']]" "$D/results.json"
    # quantized GEMMs (the suite's quant section): invariant / stock time, weight bytes and bits per shape, format and M
    $PY -c "import json,sys; [print('[quant] %(model)s %(shape)s %(format)s M=%(M)s: %(ratio).3fx %(stock)s, %(ratio_to_bf16).3fx bf16, bytes %(bytes_ratio).3f of bf16, alone bitwise invariant=%(invariant_alone_bitwise_equal)s stock=%(stock_alone_bitwise_equal)s' % r) for r in json.load(open(sys.argv[1])).get('quant', []) if r['ratio'] is not None]" "$D/results.json"
    # LoRA (the suite's lora section): tokens/s relative to the base model per phase and adapter count (goal: <= 1.10 at 4)
    $PY -c "import json,sys; [print('[lora] %(mode)s %(phase)s adapters=%(adapters)s: %(tokens_per_s).0f tok/s, %(time_ratio_to_base).3fx base, bitwise %(bitwise_rows_equal)s/%(bitwise_rows_checked)s' % r) for r in json.load(open(sys.argv[1])).get('lora', []) if r['time_ratio_to_base'] is not None]" "$D/results.json"
  else
    echo "no results.json in $D; see $D/suite.log"
  fi
done
echo "tests rc $TESTS_RC, golden digests rc $GOLDEN_RC, tensor parallelism rc $TP_RC, suite rc $SUITE_RC, extra presets rc $EXTRA_RC, ${TOTAL}s"
exit $(( TESTS_RC != 0 || GOLDEN_RC != 0 || TP_RC != 0 || SUITE_RC != 0 || EXTRA_RC != 0 ))
