#!/usr/bin/env bash
# The GPU check in one script, for a bare CUDA machine with PyTorch and Triton preinstalled and
# no network (e.g. one H200, Python 3.12, torch 2.11, triton 3.6). Run from anywhere:
#
#     OUT=<dir> bash bench/gpu_check.sh        # every file -> <dir> (eight files, no folders)
#     bash bench/gpu_check.sh                  # results -> bench/results/, logs -> /tmp/erpo-gpu-check/
#     ERPO_BENCH_COMMIT=<sha> ...              # the commit to record when .git did not travel
#
# Nothing is fetched and the project is not installed: it runs from this checkout on
# PYTHONPATH with the machine's own packages. Every phase runs under `timeout`, and the whole
# script ends within about T_TOTAL seconds (default 570, 9.5 minutes):
#   0. environment; stops at once (exit 2, summary.txt says why) when no CUDA device is visible
#   0b. python -m bench tune --device cuda (limit T_TUNE, default 60): the tile candidates of this
#      GPU's architecture that pass the compile check, timed at D x V = 4096 x 151,936 (bf16); the
#      fastest goes to tiles.json (ERPO_TUNING_FILE, exported: the later phases launch with it)
#   1. peer wheels from .whl/ when that folder travelled (pip --no-index --no-deps into /tmp):
#      liger-kernel, cut-cross-entropy, and trl (trl==1.16.0, pure Python; made with
#      `pip download trl==1.16.0 --no-deps -d .whl`), whose peers (trl, trl-chunked,
#      trl-triton) and tests/test_trl_integration.py also need transformers on the image
#   2. the tests with the compiled kernels (TRITON_INTERPRET unset), the modules that import
#      erpo_kernels first, on WORKERS processes when pytest-xdist is there (limit T_TESTS);
#      modules whose top-level imports are missing here are left out and listed, and without
#      math_verify (not on the GPU image) the tests named *math_verify* are deselected
#   3. python -m bench calibrate --device cuda (limit T_CAL, default 120): linear_token_logprobs
#      fwd and fwd+bwd of ours and each installed peer, and the bare lm_head GEMMs (forward
#      hidden @ W.T; backward g @ W and g.T @ hidden), at the cost model's target shapes, each
#      beside the model's prediction for this GPU (bench/results/cost.json): the model's calibration
#   4. python -m bench kernels --device cuda --quick: gets the time the tests left over,
#      minus what steps 5 and 6 need; starts no new case in its last 60 s (or last half)
#   5. python -m bench step --device cuda --quick  (at least T_STEP)
#   6. summary.txt: exit codes, the tests' result line and the generated tables
# The results file is rewritten after every measurement, so a phase stopped at its limit keeps
# what it measured. Files: tune.log, tiles.json, tests.log, calibrate.log, kernels.log, step.log, summary.txt,
# <machine>.json and
# <machine>.png (machine from the GPU's name, e.g. nvidia-h200).
# Afterwards, on the development machine: python -m bench merge <those files>/nvidia-h200.json
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEST=${OUT:-$ROOT/bench/results}       # <machine>.json and its plot
LOGS=${OUT:-/tmp/erpo-gpu-check}        # tests.log, kernels.log, step.log, summary.txt
mkdir -p "$DEST" "$LOGS"
PY=${PYTHON:-python3}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
# Limits (seconds). Before the kernels at most 15 + 45 + T_TUNE + 20 + T_TESTS + T_CAL + 10; the kernels
# get what is left of T_TOTAL after T_STEP and T_SUMMARY (>= 60 s with the defaults); each `timeout -k 5`
# may add 5 s, so the script ends within T_TOTAL + 30.
T_TOTAL=${T_TOTAL:-570}
T_TUNE=${T_TUNE:-60}
T_TESTS=${T_TESTS:-150}
T_CAL=${T_CAL:-100}
T_STEP=${T_STEP:-80}
T_SUMMARY=30
WORKERS=${WORKERS:-8}                   # pytest-xdist workers (0: one process)

echo "== [$(elapsed)s] environment"
ENV_INFO=$( { timeout 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
              2>/dev/null || echo "nvidia-smi: not available"; } ; timeout 45 $PY - 2>&1 <<'EOF'
import sys
import torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"missing ({e})"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {tv}, "
      f"cuda available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit(3)
print("device:", torch.cuda.get_device_name(0))
EOF
)
RC_ENV=$?
echo "$ENV_INFO"
if [ $RC_ENV -ne 0 ]; then
  { echo "$ENV_INFO"
    echo "environment check failed (exit $RC_ENV; 3: no CUDA device visible): nothing was tested or measured"
  } > "$LOGS/summary.txt"
  echo "== [$(elapsed)s] stopped: no PyTorch with a visible CUDA device; see $LOGS/summary.txt"
  exit 2
fi

export ERPO_TUNING_FILE=${ERPO_TUNING_FILE:-$LOGS/tiles.json}
echo "== [$(elapsed)s] bench tune (limit ${T_TUNE}s) -> $ERPO_TUNING_FILE"
timeout -k 5 "$T_TUNE" $PY -m bench tune --device cuda --shapes 4096x151936 --dtypes bf16 \
  --budget-s $(( T_TUNE > 40 ? T_TUNE - 30 : T_TUNE / 2 )) --out "$ERPO_TUNING_FILE" > "$LOGS/tune.log" 2>&1
RC_TUNE=$?
tail -n 12 "$LOGS/tune.log"
[ $RC_TUNE -eq 124 ] && echo "  tune: stopped at the ${T_TUNE}s limit (a finished entry is saved)"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "== [$(elapsed)s] peer wheels from .whl/"
  SITE=/tmp/erpo-site
  if timeout 20 $PY -m pip install -q --disable-pip-version-check --no-deps --no-index --no-compile \
       --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$SITE"   # after the project and the image's packages
    ls .whl/*.whl | sed 's/^/  installed /'
  else
    echo "  pip could not install the wheels; the peers will be listed as absent"
  fi
fi

echo "== [$(elapsed)s] tests (compiled kernels, limit ${T_TESTS}s)"
# The test modules to run, those importing erpo_kernels first; a module whose top-level
# imports are missing here is left out (listed). tests/ is on the path as pytest puts it there
# (for helpers such as tests/_compare.py).
TEST_FILES=$($PY - <<'EOF'
import ast, importlib.util, pathlib, sys
sys.path.insert(0, "tests")
first, rest = [], []
for path in sorted(pathlib.Path("tests").glob("test_*.py")):
    tops = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    missing = set()
    for top in tops:
        try:
            if importlib.util.find_spec(top) is None:
                missing.add(top)
        except (ImportError, ValueError):
            missing.add(top)
    if missing:
        print(f"  leaving out {path}: missing {', '.join(sorted(missing))}", file=sys.stderr)
    else:
        (first if "erpo_kernels" in tops else rest).append(str(path))
print(" ".join(first + rest))
EOF
)
OPTS=(-v -p no:cacheprovider -rfE --durations=10 --continue-on-collection-errors)  # -v: a line per test
$PY -c "import pytest_timeout" 2>/dev/null && OPTS+=(--timeout=120)
[ "$WORKERS" -gt 0 ] && $PY -c "import xdist" 2>/dev/null && OPTS+=(-n "$WORKERS")
if ! $PY -c "import math_verify" 2>/dev/null; then  # imported inside erpo.rewards, not by the tests
  echo "  deselecting the tests named *math_verify*: math_verify is not installed here"
  OPTS+=(-k "not math_verify")
fi
timeout -k 5 "$T_TESTS" $PY -m pytest "${OPTS[@]}" ${TEST_FILES:-tests} > "$LOGS/tests.log" 2>&1
RC_TESTS=$?
tail -n 25 "$LOGS/tests.log"; echo
# pytest's last line ("N passed, M failed in S s"); when it was stopped, the count so far
TESTS_RESULT=$(grep -E " in [0-9.]+s( \(.*\))?( =+)?$" "$LOGS/tests.log" | tail -n 1)
[ -n "$TESTS_RESULT" ] || TESTS_RESULT="no result line (exit $RC_TESTS): $(grep -c ' PASSED' "$LOGS/tests.log") passed, \
$(grep -c -E ' (FAILED|ERROR)' "$LOGS/tests.log") failed or errors before it stopped"
[ $RC_TESTS -eq 124 ] && echo "  tests: stopped at the ${T_TESTS}s limit"

echo "== [$(elapsed)s] bench calibrate (limit ${T_CAL}s)"
timeout -k 5 "$T_CAL" $PY -m bench calibrate --device cuda --budget-s $(( T_CAL > 60 ? T_CAL - 40 : T_CAL / 2 )) \
  --out-dir "$DEST" --no-report > "$LOGS/calibrate.log" 2>&1
RC_CAL=$?
grep -E "^\[calibrate|^==" "$LOGS/calibrate.log" | tail -n 40
[ $RC_CAL -eq 124 ] && echo "  calibrate: stopped at the ${T_CAL}s limit (finished cases are saved)"
[ $RC_CAL -ne 0 ] && [ $RC_CAL -ne 124 ] && tail -n 5 "$LOGS/calibrate.log"

T_KERNELS=$(( T_TOTAL - $(elapsed) - T_STEP - T_SUMMARY ))
echo "== [$(elapsed)s] bench kernels (limit ${T_KERNELS}s)"
BUDGET=$(( T_KERNELS > 120 ? T_KERNELS - 60 : T_KERNELS / 2 ))   # no new case after this
timeout -k 5 "$T_KERNELS" $PY -m bench kernels --device cuda --quick --budget-s $BUDGET \
  --out-dir "$DEST" --no-report > "$LOGS/kernels.log" 2>&1
RC_KERNELS=$?
grep -E "^\[bench|^==|^  (token|linear|skipped)" "$LOGS/kernels.log" | tail -n 40
[ $RC_KERNELS -eq 124 ] && echo "  kernels: stopped at the ${T_KERNELS}s limit (finished cases are saved)"
[ $RC_KERNELS -ne 0 ] && [ $RC_KERNELS -ne 124 ] && tail -n 5 "$LOGS/kernels.log"

T_STEP_NOW=$(( T_TOTAL - $(elapsed) - T_SUMMARY ))
echo "== [$(elapsed)s] bench step (limit ${T_STEP_NOW}s)"
timeout -k 5 "$T_STEP_NOW" $PY -m bench step --device cuda --quick --budget-s $(( T_STEP_NOW - 40 )) \
  --out-dir "$DEST" --no-report > "$LOGS/step.log" 2>&1
RC_STEP=$?
tail -n 12 "$LOGS/step.log"
[ $RC_STEP -eq 124 ] && echo "  step: stopped at the ${T_STEP_NOW}s limit (finished variants are saved)"

echo "== [$(elapsed)s] summary"
{
  echo "$ENV_INFO"
  echo "exit codes: tune $RC_TUNE, tests $RC_TESTS, calibrate $RC_CAL, kernels $RC_KERNELS, step $RC_STEP (124 = time limit)"
  echo "tiles: $( [ -f "$ERPO_TUNING_FILE" ] && cat "$ERPO_TUNING_FILE" | tr -d '\n' | cut -c1-600 || echo 'no tuning file: default tiles')"
  echo "tests: $TESTS_RESULT"
  timeout -k 5 "$T_SUMMARY" $PY -m bench report --out-dir "$DEST" --print 2>&1
  echo "total: $(elapsed) s; results in $DEST: $(cd "$DEST" && ls | tr '\n' ' '); logs in $LOGS"
} | tee "$LOGS/summary.txt"
[ $RC_TESTS -eq 0 ] && [ $RC_CAL -eq 0 ] && [ $RC_KERNELS -eq 0 ] && [ $RC_STEP -eq 0 ]
