#!/usr/bin/env bash
# One call on a CUDA machine yields every GPU result to commit, in one folder:
#   tools/device_check.sh [OUT_DIR]          (default: bench/results/)
# It runs the `cuda`-marked tests, the CUDA benchmark and a 235B plan, in under
# 8 minutes on one H200. It sets itself up on a bare machine that has the repo:
# a Python whose torch imports with CUDA is used as it is (system or .venv-cuda);
# otherwise .venv-cuda is created and torch is installed from the default index.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${1:-bench/results}"
mkdir -p "$OUT"
LOG="$OUT/device-check.log"
: >"$LOG"
VENV=.venv-cuda
REQUIREMENTS=(transformers networkx pyyaml tqdm pytest)

say() { echo "[device_check] $*" | tee -a "$LOG"; }

has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

has_requirements() {
    "$1" -c 'import transformers, networkx, yaml, tqdm, pytest' 2>/dev/null
}

pick_python() {
    local candidate
    for candidate in "$VENV/bin/python" python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && has_cuda_torch "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

PY="$(pick_python)"
if [[ -z "$PY" ]]; then
    say "no Python with a CUDA torch found; creating $VENV and installing torch (default index)"
    python3 -m venv --system-site-packages "$VENV" || { say "error: python3 -m venv failed"; exit 2; }
    "$VENV/bin/pip" install --quiet torch >>"$LOG" 2>&1 || say "pip install torch failed (offline?)"
    PY="$VENV/bin/python"
    if ! has_cuda_torch "$PY"; then
        say "error: no CUDA torch available; install one (pip install torch) and rerun"
        exit 2
    fi
fi
if ! has_requirements "$PY"; then
    if [[ "$PY" != "$VENV/bin/python" ]]; then
        say "$PY lacks ${REQUIREMENTS[*]}; creating $VENV on top of its site-packages"
        "$PY" -m venv --system-site-packages "$VENV" || { say "error: venv failed"; exit 2; }
        PY="$VENV/bin/python"
    fi
    "$PY" -m pip install --quiet "${REQUIREMENTS[@]}" >>"$LOG" 2>&1 \
        || say "pip install of ${REQUIREMENTS[*]} failed (offline?)"
fi
# The repo itself is imported from the working tree: no install, no network.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG" "$OUT/device-check-env.txt"
import sys, torch, transformers
print("python", sys.executable, sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("transformers", transformers.__version__)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi >>"$OUT/device-check-env.txt" 2>&1

status=0
say "cuda-marked tests"
timeout 100 "$PY" -m pytest -m cuda -q -p no:cacheprovider \
    --junitxml="$OUT/cuda-tests.xml" tests 2>&1 | tee "$OUT/cuda-tests.log" | tail -n 20
test_rc=${PIPESTATUS[0]}
say "cuda tests exit status: $test_rc"
[[ $test_rc -eq 0 ]] || status=1

# One process per sequence length: each mode's pinned host buffers live until its
# process exits, and at 8192 tokens three pools of ~40 GiB would crowd 128 GiB of RAM.
# 16384 tokens is left out: eager attention's saved probabilities (48 GiB per layer)
# do not fit the no-swap baseline.
bench() {  # seconds, tag, bench arguments...
    local seconds=$1 tag=$2
    shift 2
    say "CUDA benchmark $tag"
    timeout "$seconds" "$PY" tools/bench_swap.py --device cuda --tag "$tag" --out-dir "$OUT" \
        "$@" 2>&1 | tee "$OUT/bench-cuda-$tag.log" | tail -n 30
    local rc=${PIPESTATUS[0]}
    say "benchmark $tag exit status: $rc"
    [[ $rc -eq 0 ]] || status=1
}
bench 120 seq4096 --seq 4096 --whole-layer --steps 8 --warmup 2
bench 200 seq8192 --seq 8192 --steps 6 --warmup 2

say "235B plan at 32k tokens"
timeout 40 "$PY" -m graphswap.cli plan-memory --preset qwen3-235b-a22b --seq 32768 \
    --format json >"$OUT/plan-qwen3-235b-a22b-32k.json" 2>>"$LOG" || status=1

say "done (status $status); results in $OUT"
exit "$status"
