#!/usr/bin/env bash
# The GPU check, in one script, for a bare CUDA machine with PyTorch and Triton preinstalled
# and no network (e.g. one H200, torch 2.11, triton 3.6, Python 3.12). Run from anywhere:
#
#     bash bench/gpu_check.sh                  # results + logs -> $OUT (unset: bench/results/ + /tmp/erpo-gpu-check/)
#     ERPO_BENCH_COMMIT=<sha> bash bench/gpu_check.sh   # record the commit when .git did not travel
#
# Phases, each guarded by `timeout` so the whole script ends in under 8 minutes:
#   1. the project on PYTHONPATH (no install, no dependencies); peer wheels from .whl/ when
#      that folder is present (pip --no-deps --no-index into /tmp/erpo-site)
#   2. the test suite with the compiled kernels (TRITON_INTERPRET unset); test modules whose
#      imports are missing here (e.g. math_verify) are skipped by --ignore and listed
#   3. python -m bench kernels --device cuda --quick   (time-budgeted; partial results are kept)
#   4. python -m bench step --device cuda --quick
#   5. a short summary (tests, erpo vs eager, roofline, step), also written to summary.txt
# Afterwards, on the development machine: python -m bench merge <that>/nvidia-h200.json
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
# Phase limits (seconds); the sum stays under 8 minutes with room for start-up.
T_TESTS=${T_TESTS:-180}
T_KERNELS=${T_KERNELS:-165}
T_STEP=${T_STEP:-100}

echo "== [$(elapsed)s] environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
$PY - <<'EOF'
import sys, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"missing ({e})"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {tv}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
EOF

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "== [$(elapsed)s] peer wheels from .whl/"
  SITE=/tmp/erpo-site
  if timeout 120 $PY -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade \
       --target "$SITE" .whl/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$SITE"   # after the project and the image's packages
    ls .whl/*.whl | sed 's/^/  installed /'
  else
    echo "  pip could not install the wheels; the peers will be listed as absent"
  fi
fi

echo "== [$(elapsed)s] tests (compiled kernels, limit ${T_TESTS}s)"
IGNORE=$($PY - <<'EOF'
# Test modules whose top-level imports are missing on this machine: --ignore them (listed).
import ast, importlib.util, pathlib
for path in sorted(pathlib.Path("tests").glob("test_*.py")):
    missing = set()
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            try:
                if importlib.util.find_spec(top) is None:
                    missing.add(top)
            except (ImportError, ValueError):
                missing.add(top)
    if missing:
        print(f"--ignore={path}")
        import sys; print(f"  skipping {path}: missing {', '.join(sorted(missing))}", file=sys.stderr)
EOF
)
TIMEOUT_OPT=""
$PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT_OPT="--timeout=120"
timeout -k 10 "$T_TESTS" $PY -m pytest -q -p no:cacheprovider $TIMEOUT_OPT --continue-on-collection-errors \
  $IGNORE tests > "$LOGS/tests.log" 2>&1
RC_TESTS=$?
tail -n 15 "$LOGS/tests.log"
[ $RC_TESTS -eq 124 ] && echo "  tests: stopped at the ${T_TESTS}s limit"

echo "== [$(elapsed)s] bench kernels (limit ${T_KERNELS}s)"
timeout -k 10 "$T_KERNELS" $PY -m bench kernels --device cuda --quick --budget-s $(( T_KERNELS - 60 )) \
  --out-dir "$DEST" --no-report > "$LOGS/kernels.log" 2>&1
RC_KERNELS=$?
grep -E "^\[bench|^==|^  (token|linear)" "$LOGS/kernels.log" | tail -n 40
[ $RC_KERNELS -eq 124 ] && echo "  kernels: stopped at the ${T_KERNELS}s limit (finished cases are saved)"
[ $RC_KERNELS -ne 0 ] && [ $RC_KERNELS -ne 124 ] && tail -n 5 "$LOGS/kernels.log"

echo "== [$(elapsed)s] bench step (limit ${T_STEP}s)"
timeout -k 10 "$T_STEP" $PY -m bench step --device cuda --quick --budget-s $(( T_STEP - 40 )) \
  --out-dir "$DEST" --no-report > "$LOGS/step.log" 2>&1
RC_STEP=$?
tail -n 12 "$LOGS/step.log"
[ $RC_STEP -eq 124 ] && echo "  step: stopped at the ${T_STEP}s limit (finished variants are saved)"

echo "== [$(elapsed)s] summary"
{
  echo "exit codes: tests $RC_TESTS, kernels $RC_KERNELS, step $RC_STEP (124 = time limit)"
  echo "tests: $(grep -E '(passed|failed|error)' "$LOGS/tests.log" | tail -n 1)"
  timeout 60 $PY -m bench report --out-dir "$DEST" --print 2>&1
  echo "total: $(elapsed) s; results in $DEST: $(cd "$DEST" && ls | tr '\n' ' '); logs in $LOGS"
} | tee "$LOGS/summary.txt"
[ $RC_TESTS -eq 0 ] && [ $RC_KERNELS -eq 0 ] && [ $RC_STEP -eq 0 ]
