#!/usr/bin/env bash
# The CUDA backend on a GPU machine, in one go, within a hard time budget (450 s by default, so a device loan's
# 8 minutes are never passed): build libkiln_cuda.so, probe it, run the GPU half of every CUDA test (kernels against
# their numpy twins, the library, CudaModel and its decoding against the CPU engine, SFT/GRPO/OPD runs within
# tolerance of cpu and cancel-then-resume ==, serving and evaluations, the API's cancel-then-resume byte for byte,
# kiln qualify --backend cuda in fresh processes), time bench/cuda_step.py (Kiln's LoRA step against PyTorch CUDA +
# peft in FP32 and BF16 on SmolLM2-135M, context 1024, batch 8), run the attention kernels' GPU tests under
# compute-sanitizer (memcheck, racecheck, synccheck: the races the host emulation cannot show) where it is installed
# and supports the device, and print one summary.
#   bench/cuda_check.sh [--budget SECONDS] [--no-build]
#     (from a checkout whose .venv ./dev has made, or with PYTHON=...)
# Each step runs under `timeout` for the smaller of its own cap and what the budget has left once the later steps'
# minimums are set aside; a step that would get less than its minimum is not started. The summary names every step
# that ran out of time, and every step that failed or was skipped, with the reason; the exit status is 0 only when
# all of them passed. --no-build probes the library as it is (no pip install). Without a usable device the tests
# and the benchmark are skipped with the probe's reason.
# On a GPU machine that cannot reach a package index (the device loan), carry .whl/ made here by
# bench/device_kit.sh: its wheels are installed into a scratch folder first and nothing is downloaded.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
export PYTHON
MAX_BUDGET=450  # a device loan's command may run 8 minutes; what is left of them covers the summary
BUDGET="$MAX_BUDGET"
BUILD=1
usage() { sed -n '8,9s/^# \{0,1\}//p' bench/cuda_check.sh >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) [ $# -ge 2 ] || usage; BUDGET="$2"; shift ;;
        --no-build) BUILD=0 ;;
        *) usage ;;
    esac
    shift
done
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 1 ] || [ "$BUDGET" -gt "$MAX_BUDGET" ]; then
    printf 'cuda_check: --budget must be 1 to %s seconds, not %s\n' "$MAX_BUDGET" "$BUDGET" >&2
    exit 2
fi
DEADLINE=$((SECONDS + BUDGET))
LOG="$(mktemp -d "${TMPDIR:-/tmp}/kiln-cuda-check.XXXXXX")"
say() { printf 'cuda_check: %s\n' "$*" >&2; }
from_dev() { bash -c 'source ./dev && "$@"' cuda_check "$@"; }  # ./dev's find_nvcc (setup.py's rule), cublas_wheel

# the steps in order: at most CAP seconds each, not started with less than FLOOR (both include GRACE); the FLOOR of
# each step still PENDING is kept for it while an earlier one runs
STEPS=(prepare build probe tests bench sanitize)
declare -A CAP=([prepare]=120 [build]=240 [probe]=60 [tests]=330 [bench]=210 [sanitize]=90)
declare -A FLOOR=([prepare]=10 [build]=30 [probe]=10 [tests]=60 [bench]=60 [sanitize]=20)
declare -A PENDING=([prepare]=1 [build]=1 [probe]=1 [tests]=1 [bench]=1 [sanitize]=1)
settle() { unset "PENDING[$1]"; }  # settle STEP: it ran or will not run, so it keeps no time
GRACE=5  # timeout's --kill-after: a step that ignores SIGTERM is killed this much later
OUT_OF_TIME=()
STOPPED=""
TOOK=""

timed() {  # timed STEP LOG COMMAND...: COMMAND within STEP's share of the budget, output to LOG, and its status;
           # TOOK is how long it ran, and STOPPED says why when it was not started or was stopped for time
    local name="$1" log="$2" later=0 seen=0 step left allowed status started
    shift 2
    STOPPED=""
    TOOK=""
    settle "$name"
    for step in "${STEPS[@]}"; do
        [ "$seen" = 1 ] && [ -n "${PENDING[$step]:-}" ] && later=$((later + FLOOR[$step]))
        [ "$step" = "$name" ] && seen=1
    done
    left=$((DEADLINE - SECONDS))
    allowed=$((left - later))
    [ "$allowed" -gt "${CAP[$name]}" ] && allowed="${CAP[$name]}"
    if [ "$allowed" -lt "${FLOOR[$name]}" ]; then
        OUT_OF_TIME+=("$name")
        STOPPED="out of time: not started (${left} s of the ${BUDGET} s budget left, ${later} s of it kept for the"
        STOPPED+=" later steps; it needs ${FLOOR[$name]} s)"
        return 125
    fi
    started=$SECONDS
    timeout --kill-after="$GRACE" "$((allowed - GRACE))" "$@" >"$log" 2>&1
    status=$?
    TOOK="$((SECONDS - started)) s"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        OUT_OF_TIME+=("$name")
        STOPPED="out of time: stopped after $TOOK, its share of the ${BUDGET} s budget (see $log)"
    fi
    return "$status"
}

nvcc="$(from_dev find_nvcc "$PYTHON")" || nvcc=""
offline=""
compgen -G ".whl/*.whl" >/dev/null && offline=1
{ [ "$BUILD" = 1 ] && [ -n "$nvcc" ]; } || settle build
{ [ -n "$offline" ] || [ -n "${PENDING[build]:-}" ]; } || settle prepare

# 1. prepare: the device kit's wheels (offline), else the cuBLAS wheel matching nvcc, as ./dev installs it
if [ -n "$offline" ]; then
    site="${TMPDIR:-/tmp}/kiln-site"
    if timed prepare "$LOG/prepare.log" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$site" .whl/*.whl; then
        prepare="ok: $(ls .whl/*.whl | wc -l) wheels from .whl/ on PYTHONPATH ($TOOK)"
    elif [ -n "$STOPPED" ]; then
        prepare="$STOPPED"
    else
        prepare="FAILED: the device kit's wheels did not install (see $LOG/prepare.log)"
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif [ "$BUILD" = 0 ] || [ -z "$nvcc" ]; then
    prepare="nothing to install"
elif ! wheel="$(from_dev cublas_wheel "$nvcc" 2>"$LOG/prepare.log")"; then
    prepare="skipped: $(tail -1 "$LOG/prepare.log" | sed 's/^dev: //')"
elif timed prepare "$LOG/prepare.log" "$PYTHON" -m pip install --quiet --no-input "$wheel"; then
    prepare="ok: $wheel ($TOOK)"
elif [ -n "$STOPPED" ]; then
    prepare="$STOPPED"
else
    prepare="FAILED: pip install $wheel (see $LOG/prepare.log); the build may not find cuBLAS"
fi
say "prepare: $prepare"

# 2. build: the editable install runs setup.py, which builds the library (KILN_REQUIRE_CUDA=1: a failed compile
# fails the install) and writes what became of it to native_ext/libkiln_cuda.build.txt
NOTE_FILE=native_ext/libkiln_cuda.build.txt
if [ "$BUILD" = 0 ]; then
    build="skipped: --no-build (the library as it is)"
elif [ -z "$nvcc" ]; then
    build="skipped: nvcc not found (setup.py's rule: KILN_NVCC, PATH, \$CUDA_HOME, \$CUDA_PATH, /usr/local/cuda)"
else
    isolation=()
    # the image's setuptools, Cython, numpy and nvidia-cublas; nothing to fetch
    [ -n "$offline" ] && isolation=(--no-build-isolation --no-index)
    rm -f "$NOTE_FILE"
    if timed build "$LOG/build.log" env KILN_REQUIRE_CUDA=1 "$PYTHON" -m pip install --quiet --no-input --no-deps \
            "${isolation[@]}" -e .; then
        if [ -f native_ext/libkiln_cuda.so ] && grep -qE '^(built|.* is up to date)' "$NOTE_FILE" 2>/dev/null; then
            build="ok in $TOOK: $(cat "$NOTE_FILE")"
        else
            build="FAILED: the install passed but the CUDA library was not built: $(cat "$NOTE_FILE" 2>/dev/null ||
                echo "setup.py left no note") (see $LOG/build.log)"
        fi
    elif [ -n "$STOPPED" ]; then
        build="$STOPPED"
    else
        build="FAILED: $(cat "$NOTE_FILE" 2>/dev/null || tail -1 "$LOG/build.log") (see $LOG/build.log)"
    fi
fi
say "build: $build"

# 3. probe
device=""
PROBE="$(cat <<'PY'
from native_ext.cuda import probe
p = probe()
devices = ", ".join(f"{d['name']} ({d['compute_capability']})" for d in p["devices"]) or "none"
print(("available: " + devices) if p["available"] else f"unavailable [{p['code']}]: {p['reason']}")
PY
)"
if timed probe "$LOG/probe.log" "$PYTHON" -c "$PROBE"; then
    probe="$(tail -1 "$LOG/probe.log")"
    case "$probe" in available:*) device=1 ;; *) device=0 ;; esac
elif [ -n "$STOPPED" ]; then
    probe="$STOPPED"
else
    probe="FAILED: $(tail -1 "$LOG/probe.log") (see $LOG/probe.log)"
fi
say "probe: $probe"
# the tests and the benchmark need the device the probe found
case "$device:$probe" in
    1:*) no_device="" ;;
    0:*) no_device="skipped: no usable CUDA device (the probe says why)" ;;
    :"out of time"*) no_device="out of time: not started (the probe did not finish)"
                     OUT_OF_TIME+=(tests bench sanitize) ;;
    *) no_device="skipped: the probe failed" ;;
esac
[ -z "$no_device" ] || { settle tests; settle bench; settle sanitize; }
# compute-sanitizer: on PATH, beside nvcc, or in the toolkit's usual place
sanitizer="$(command -v compute-sanitizer 2>/dev/null)"
for candidate in "${nvcc:+$(dirname "$nvcc")/compute-sanitizer}" /usr/local/cuda/bin/compute-sanitizer; do
    [ -z "$sanitizer" ] && [ -n "$candidate" ] && [ -x "$candidate" ] && sanitizer="$candidate"
done
[ -n "$sanitizer" ] || settle sanitize

# 4. tests: the GPU halves only (-k "not emulated"): the emulated halves run in every CI run on any machine
if [ -n "$no_device" ]; then
    tests="$no_device"
elif timed tests "$LOG/tests.log" "$PYTHON" -m pytest -q -p no:cacheprovider -rs -k "not emulated" \
        tests/engine/test_cuda_kernels.py tests/engine/test_cuda_library.py tests/engine/test_cuda_model.py \
        tests/engine/test_cuda_decode.py tests/engine/test_serving_cuda.py tests/runs/test_sft_cuda.py \
        tests/runs/test_grpo_opd_cuda.py tests/evals/test_evals_cuda.py tests/serving/test_serving_cuda.py \
        "tests/controlplane/test_e2e_embedded.py::test_cancel_then_resume_on_cuda_is_byte_identical" \
        "tests/runs/test_qualify.py::test_every_route_qualifies_on_cuda_in_fresh_processes"; then
    tests="passed in $TOOK: $(tail -1 "$LOG/tests.log")"
elif [ -n "$STOPPED" ]; then
    tests="$STOPPED"
else
    tests="FAILED: $(tail -1 "$LOG/tests.log") (see $LOG/tests.log)"
fi
say "tests: $tests"

# 5. benchmark: cuda_step.py exits non-zero when a side did not run, and its `result:` line says which and why
if [ -n "$no_device" ]; then
    bench="$no_device"
elif timed bench "$LOG/bench.log" "$PYTHON" bench/cuda_step.py --steps 5 --context 1024 --batch 8; then
    bench="ok in $TOOK: $(grep '^result: ' "$LOG/bench.log" | tail -1 | sed 's/^result: ok: //')"
elif [ -n "$STOPPED" ]; then
    bench="$STOPPED"
elif grep -q '^result: ' "$LOG/bench.log"; then
    bench="$(grep '^result: ' "$LOG/bench.log" | tail -1 | sed 's/^result: //')"
else
    bench="FAILED: $(tail -1 "$LOG/bench.log") (see $LOG/bench.log)"
fi

# 6. sanitizer: the attention kernels' GPU tests under each tool; a tool that refuses the device (seen on gVisor:
# "Device not supported") skips the step, any error it reports fails it
if [ -n "$no_device" ]; then
    sanitize="$no_device"
elif [ -z "$sanitizer" ]; then
    sanitize="skipped: compute-sanitizer not found (PATH, beside nvcc, /usr/local/cuda/bin)"
elif timed sanitize "$LOG/sanitize.log" bash -c 'for tool in memcheck racecheck synccheck; do
            echo "== $tool"; "$0" --tool "$tool" --error-exitcode 3 "$PYTHON" -m pytest -q -p no:cacheprovider \
                -k "attention and not emulated" tests/engine/test_cuda_kernels.py || exit; done' "$sanitizer"; then
    sanitize="passed in $TOOK: memcheck, racecheck and synccheck on the attention kernels' GPU tests"
elif [ -n "$STOPPED" ]; then
    sanitize="$STOPPED"
elif grep -q "Device not supported" "$LOG/sanitize.log"; then
    sanitize="skipped: compute-sanitizer does not support this device (see $LOG/sanitize.log)"
else
    sanitize="FAILED: $(grep '^== ' "$LOG/sanitize.log" | tail -1 | cut -c4-) reported errors (see $LOG/sanitize.log)"
fi
say "sanitize: $sanitize"

used=$((BUDGET - (DEADLINE - SECONDS)))
echo "== Kiln CUDA check ($(date -u +%Y-%m-%dT%H:%MZ)) =="
echo "budget:  ${used} s of ${BUDGET} s used${OUT_OF_TIME[*]:+; out of time: ${OUT_OF_TIME[*]}}"
echo "prepare: $prepare"
echo "build:   $build"
echo "probe:   $probe"
echo "tests:   $tests"
echo "bench:   $bench"
[ -f "$LOG/bench.log" ] && grep -v -e '^{' -e '^result: ' "$LOG/bench.log" | tail -20
echo "sanitize: $sanitize"
echo "logs:    $LOG"
case "$prepare" in ok*|nothing*) ;; *) exit 1 ;; esac
case "$build" in ok*|"skipped: --no-build"*) ;; *) exit 1 ;; esac
[ "$device" = 1 ] && [[ "$tests" == passed* ]] && [[ "$bench" == ok* ]] &&
    { [[ "$sanitize" == passed* ]] || [[ "$sanitize" == skipped:\ compute-sanitizer* ]]; }
