#!/usr/bin/env bash
# The GPU check: one call on a CUDA machine runs the CUDA tests, the benchmark, the
# host-overhead measurement and the attention kernel's speed (the planner's
# attention_efficiency), then prints one summary line per target.
#
#   tools/device_check.sh OUT_DIR             on the GPU machine: about 3 minutes on one H200,
#                                             under 7 by the steps' time limits
#   tools/device_check.sh OUT_DIR --dry-run   the same steps on CPU with small shapes (CI)
#
# It installs nothing and reaches no network: it runs this working tree (PYTHONPATH) on the
# packages the Python at hand already has (PYTHON, default python3). Every step has its
# own time limit and writes its result files into OUT_DIR as it goes, so a step that fails
# or runs out of time leaves what it measured and the other steps still run.
# Exit status: 0 every step ran to its end; 1 a step failed or timed out; 2 bad usage, a
# missing package, or no CUDA without --dry-run. A missed target is a summary line, not an
# exit status.
#
# The result files carry stable names, the date, GPU and load inside them:
# bench-swap-cuda-<gpu>.json/.md, swap-overhead-cuda-<gpu>.json/.md, attention-speed.json.
# To record a GPU run, copy those into bench/results/ as they are, replacing the earlier
# ones (git keeps them), and update the tables of docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() {
    echo "usage: tools/device_check.sh OUT_DIR [--dry-run]" >&2
    exit 2
}
[[ $# -eq 1 || ($# -eq 2 && $2 == --dry-run) ]] || usage
OUT=$1
DRY_RUN=$([[ $# -eq 2 ]] && echo 1 || echo 0)
PY=${PYTHON:-python3}
mkdir -p "$OUT" || exit 2
LOG=$OUT/device-check.log
: >"$LOG"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8

if ((DRY_RUN)); then
    # A rehearsal, not a measurement: one thread keeps it quick on a shared CI machine.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    TEST_LIMIT=300 BENCH_LIMIT=600 OVERHEAD_LIMIT=300 ATTENTION_LIMIT=120
    BENCH_ARGS=(--device cpu --attn eager --layers 3 --seq 256 --steps 1 --warmup 0 --share-seq 256)
    OVERHEAD_ARGS=(--device cpu --steps 5 --warmup 1)
    ATTENTION_ARGS=(--device cpu --seq 256 --heads 4 --kv-heads 2 --head-dim 64 --repeats 1)
else
    TEST_LIMIT=90 BENCH_LIMIT=190 OVERHEAD_LIMIT=40 ATTENTION_LIMIT=45
    BENCH_ARGS=(--device cuda)
    OVERHEAD_ARGS=(--device cuda)
    ATTENTION_ARGS=(--device cuda)
fi

say() { echo "[device_check] $*" | tee -a "$LOG"; }

say "environment ($OUT/environment.txt)"
DRY_RUN=$DRY_RUN "$PY" - >"$OUT/environment.txt" 2>&1 <<'EOF'
import importlib, importlib.util, os, sys

names = ("torch", "transformers", "networkx", "yaml", "tqdm", "pytest", "hypothesis")
print("python", sys.executable, sys.version.split()[0])
# Found before any is imported: a missing package is reported in a second, not after
# torch's and transformers' imports.
missing = [name for name in names if importlib.util.find_spec(name) is None]
if missing:
    print("error: missing packages:", ", ".join(missing))
    sys.exit(2)
for name in names:
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        print(f"error: {name} is installed but does not import: {error}")
        sys.exit(2)
    print(name, getattr(module, "__version__", "?"))
import torch

print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
elif os.environ["DRY_RUN"] != "1":
    print("error: torch sees no CUDA device; run with --dry-run for the CPU rehearsal")
    sys.exit(2)
EOF
env_rc=$?
sed 's/^/    /' "$OUT/environment.txt" | tee -a "$LOG"
((env_rc == 0)) || exit 2
command -v nvidia-smi >/dev/null && nvidia-smi >>"$OUT/environment.txt" 2>&1

status=0
run_step() { # name, seconds, log file, command...
    local name=$1 seconds=$2 log=$3 start=$SECONDS rc
    shift 3
    say "$name: start (limit ${seconds}s, log $log)"
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    say "$name: exit status $rc after $((SECONDS - start))s"
    ((rc == 0)) || status=1
}

run_step "CUDA tests" "$TEST_LIMIT" "$OUT/cuda-tests.log" \
    "$PY" -m pytest -p no:cacheprovider -q -rs --junitxml="$OUT/cuda-tests.xml" \
    tests/graphswap/runtime/test_swap_cuda.py
run_step "benchmark" "$BENCH_LIMIT" "$OUT/bench.log" \
    "$PY" tools/bench_swap.py "${BENCH_ARGS[@]}" --out-dir "$OUT"
run_step "host overhead" "$OVERHEAD_LIMIT" "$OUT/overhead.log" \
    "$PY" tools/bench_swap.py --overhead "${OVERHEAD_ARGS[@]}" --out-dir "$OUT"
# The planner's attention_efficiency: causal sdpa's rate against the profile's TFLOP/s.
run_step "attention speed" "$ATTENTION_LIMIT" "$OUT/attention.log" \
    "$PY" tools/attention_speed.py "${ATTENTION_ARGS[@]}" --out-dir "$OUT"

# One line per target: the tests' verdict from their JUnit XML, the others from the
# TARGET lines the benchmark printed; a target that never printed is missed.
DRY_RUN=$DRY_RUN "$PY" - "$OUT" >"$OUT/summary.txt" <<'EOF'
import os, re, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
dry_run = os.environ["DRY_RUN"] == "1"
lines = []
xml = out / "cuda-tests.xml"
if xml.is_file():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    counts = f"{total - skipped - failed} passed, {failed} failed, {skipped} skipped"
    if dry_run:
        verdict = "n/a" if failed == 0 and total == skipped > 0 else "missed"
        counts += "; dry run: every test collected, none can run without CUDA"
    else:
        verdict = "met" if failed == 0 and total - skipped > 0 else "missed"
    lines.append(f"cuda_tests: {verdict} ({counts})")
else:
    lines.append("cuda_tests: missed (no JUnit XML: the tests did not finish)")
expected = {
    "bench.log": (
        "numbers_unchanged",
        "peak_reduction",
        "step_time_ratio",
        "overhead_vs_save_on_cpu",
        "prediction",
        "budget_plan",
    ),
    "overhead.log": (
        "host_overhead_per_swapped_tensor",
        "host_bookkeeping_per_swapped_tensor",
        "accelerator_calls_per_swapped_tensor",
    ),
    "attention.log": ("attention_efficiency",),
}
for log, names in expected.items():
    path = out / log
    text = path.read_text(errors="replace") if path.is_file() else ""
    found = dict(re.findall(r"^TARGET (\w+): (.*)$", text, flags=re.M))
    for name in names:
        lines.append(f"{name}: {found.get(name, f'missed (no result: see {path})')}")
print("\n".join(lines))
EOF
say "summary ($OUT/summary.txt)"
sed 's/^/    /' "$OUT/summary.txt" | tee -a "$LOG"
say "done: exit status $status; results in $OUT"
exit "$status"
