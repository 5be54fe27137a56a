#!/usr/bin/env bash
# The CUDA backend on a GPU machine, in one go (under 8 minutes): build libkiln_cuda.so, probe it, run the GPU
# half of every CUDA test (kernels against their numpy twins, the library, CudaModel and its decoding against the
# CPU engine, SFT/GRPO/OPD runs within tolerance of cpu and cancel-then-resume ==, serving and evaluations, the
# API's cancel-then-resume byte for byte, kiln qualify --backend cuda in fresh processes), time
# bench/cuda_step.py (Kiln's LoRA step against PyTorch CUDA + peft in FP32 and BF16 at the SmolLM2-135M shape,
# context 1024, batch 8), and print one summary.
#   bench/cuda_check.sh            (from a checkout whose .venv ./dev has made, or with PYTHON=...)
# On a GPU machine that cannot reach a package index (the device loan), carry .whl/ made here by
# bench/device_kit.sh: its wheels are installed into a scratch folder first and nothing is downloaded.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
LOG="$(mktemp -d "${TMPDIR:-/tmp}/kiln-cuda-check.XXXXXX")"
say() { printf 'cuda_check: %s\n' "$*" >&2; }
offline=""
if compgen -G ".whl/*.whl" >/dev/null; then
    offline=1
    site="${TMPDIR:-/tmp}/kiln-site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        >"$LOG/kit.log" 2>&1 || say "device kit: see $LOG/kit.log"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    say "device kit: $(ls .whl/*.whl | wc -l) wheels from .whl/ on PYTHONPATH"
fi

# 1. build (the cuBLAS wheel first, as ./dev does where nvcc is; then the editable install runs setup.py)
build="skipped"
nvcc="$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)"
if [ -n "$nvcc" ]; then
    major="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
    wheel="nvidia-cublas>=13,<14"; [ "$major" = 12 ] && wheel="nvidia-cublas-cu12>=12,<13"
    isolation=()
    if [ -n "$offline" ]; then  # the image's setuptools, Cython, numpy and nvidia-cublas; nothing to fetch
        isolation=(--no-build-isolation --no-index)
        say "building (nvcc $major) with the image's build tools"
    else
        say "installing $wheel and building (nvcc $major)"
        timeout 120 "$PYTHON" -m pip install --quiet --no-input "$wheel" >"$LOG/wheel.log" 2>&1 || say "cuBLAS wheel: see $LOG/wheel.log"
    fi
    start=$SECONDS
    if timeout 240 "$PYTHON" -m pip install --quiet --no-input --no-deps "${isolation[@]}" -e . >"$LOG/build.log" 2>&1; then
        build="ok in $((SECONDS - start)) s"
    else
        build="FAILED (see $LOG/build.log)"
    fi
else
    build="skipped: nvcc not found"
fi
say "build: $build"

# 2. probe
probe="$(timeout 60 "$PYTHON" - <<'PY' 2>&1 | tail -1
from native_ext.cuda import probe
p = probe()
devices = ", ".join(f"{d['name']} ({d['compute_capability']})" for d in p["devices"]) or "none"
print(("available: " + devices) if p["available"] else f"unavailable [{p['code']}]: {p['reason']}")
PY
)"
say "probe: $probe"

# 3. tests
tests="not run"
# the GPU halves only (-k "not emulated"): the emulated halves run in every CI run on any machine
if timeout 330 "$PYTHON" -m pytest -q -p no:cacheprovider -rs -k "not emulated" tests/engine/test_cuda_kernels.py \
        tests/engine/test_cuda_library.py tests/engine/test_cuda_model.py tests/engine/test_cuda_decode.py \
        tests/engine/test_serving_cuda.py tests/runs/test_sft_cuda.py tests/runs/test_grpo_opd_cuda.py \
        tests/evals/test_evals_cuda.py tests/serving/test_serving_cuda.py \
        "tests/controlplane/test_e2e_embedded.py::test_cancel_then_resume_on_cuda_is_byte_identical" \
        "tests/runs/test_qualify.py::test_every_route_qualifies_on_cuda_in_fresh_processes" \
        >"$LOG/tests.log" 2>&1; then
    tests="passed: $(tail -1 "$LOG/tests.log")"
else
    tests="FAILED: $(tail -1 "$LOG/tests.log") (see $LOG/tests.log)"
fi
say "tests: $tests"

# 4. benchmark
bench="not run"
if timeout 150 "$PYTHON" bench/cuda_step.py --steps 5 --context 1024 --batch 8 >"$LOG/bench.log" 2>&1; then
    bench="ok"
else
    bench="FAILED (see $LOG/bench.log)"
fi

echo "== Kiln CUDA check ($(date -u +%Y-%m-%dT%H:%MZ)) =="
echo "build:  $build"
echo "probe:  $probe"
echo "tests:  $tests"
echo "bench:  $bench"
grep -v '^{' "$LOG/bench.log" | tail -20
echo "logs:   $LOG"
