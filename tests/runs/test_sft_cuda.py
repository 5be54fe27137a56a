"""SFT runs on the cuda backend (issue #17): trainer.runs.sft trains on trainer.cuda_model.CudaModel while
checkpoints, resume, the final PEFT snapshot and the metrics stay those of the CPU loop (GRPO and OPD on cuda:
test_grpo_opd_cuda.py).

Each test runs on a GPU where the loader finds one (skipped, with the probe's reason, without) and on the host
emulation of the CUDA library (the same kernel source built by g++ with -DKILN_CUDA_EMULATE), which the loader
finds through KILN_CUDA_LIBRARY and reports as a device of compute capability 8.0 (tests/engine/conftest.py's
cuda_environment).

Tolerance across backends: a relative difference of 1e-4 per step's loss and gradient norm, and of the final
adapter's values (the device and the CPU engine sum in different orders). On one backend an interrupted and
resumed run ends with the same bytes as an uninterrupted one, compared with `==`.
"""

import numpy as np
import pytest
from safetensors.numpy import load as safetensors_load

from tests.engine.conftest import cuda_environment, cuda_loads, emulated_library  # noqa: F401  (fixtures)
from test_sft import RECORDS, StopAt, final_files, make_settings, request, write_dataset
from trainer.runs import checkpoint_dir
from trainer.runs.admission import MANIFEST_FIELDS, AdmissionError
from trainer.runs.sft import admit_sft, run_sft

TOLERANCE = 1e-4
# the final adapter across backends: Adam divides each element's first moment by sqrt(second moment) + 1e-8, so a
# gradient difference of 1e-4 or less can move a small step by more (test_grpo_opd_cuda's docstring measures one);
# a missed, doubled or mis-scaled step moves values by about the learning rate, far beyond it. Measured: 1.1e-4 on
# a QLoRA up_proj lora_B (0.0128603 against 0.0128586) while every loss and gradient norm agreed within 1e-4
ADAPTER_TOLERANCE = 1e-3
SMALL = RECORDS[:4]  # 2 epochs of 4 examples: 4 steps at batch 2, or at batch 1 with 2 micro-batches each
QLORA = {"quantization": {"type": "nf4", "block_size": 64, "double_quantization": True}}


@pytest.fixture
def device(cuda_loads):  # noqa: F811
    """The runs' CUDA device, twice: a GPU where the loader finds one, and the host emulation
    (tests/engine/conftest.py's cuda_environment); the list of CudaModels built (cuda_loads)."""
    return cuda_loads


def gpu_name() -> str:
    """The name of the device the runs compute on, as this process's probe reports it."""
    from native_ext import cuda

    return cuda.probe(isolated=True)["devices"][0]["name"]


def run(home, stop=None, resume=None, **config):
    """(settings, result, hooks) of one SFT run over SMALL in HOME."""
    settings = make_settings(home)
    req = request(write_dataset(home, SMALL), **config)
    if resume is not None:
        req = request(req["dataset_path"], resume_checkpoint=resume, **config)
    hooks = StopAt(stop)
    result = run_sft(admit_sft(req, settings), settings, hooks)
    return settings, result, hooks


def adapter_values(settings):
    return safetensors_load((settings.registry / "support-bot" / "adapter_model.safetensors").read_bytes())


def relative(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


CASES = {"lora-accumulation": dict(batch_size=1, gradient_accumulation_steps=2, max_grad_norm=0.05),
         "qlora": dict(QLORA, max_grad_norm=None)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_cuda_run_follows_the_cpu_run(device, tmp_path, case):
    """The same request on cpu and cuda: every step's loss, gradient norm, clip decision and learning rate within
    TOLERANCE, and the final adapter within ADAPTER_TOLERANCE; the cuda run recorded cuda and trained on the
    (emulated) device."""
    config = CASES[case]
    cpu_settings, cpu, cpu_hooks = run(tmp_path / "cpu", backend="cpu", **config)
    assert not device  # the cpu run never opened the library
    cuda_settings, gpu, gpu_hooks = run(tmp_path / "cuda", backend="cuda", **config)
    assert device, "the cuda run did not open the CUDA library"
    assert gpu.status == cpu.status == "succeeded" and gpu.steps_completed == cpu.steps_completed == 4
    assert relative(gpu.loss_history, cpu.loss_history) <= TOLERANCE
    for step, (on_gpu, on_cpu) in enumerate(zip(gpu_hooks.metrics, cpu_hooks.metrics)):
        assert on_gpu["clipped"] == on_cpu["clipped"], step
        assert abs(on_gpu["grad_norm"] - on_cpu["grad_norm"]) <= TOLERANCE * on_cpu["grad_norm"], step
        assert on_gpu["learning_rate"] == on_cpu["learning_rate"] and on_gpu["tokens"] == on_cpu["tokens"]
    if config.get("max_grad_norm"):
        assert any(m["clipped"] for m in cpu_hooks.metrics)  # the clip path ran
    expected = adapter_values(cpu_settings)
    for name, value in adapter_values(cuda_settings).items():
        assert relative(value, expected[name]) <= ADAPTER_TOLERANCE, name
    assert gpu.latest_checkpoint["complete"] is True
    path = checkpoint_dir.latest_checkpoint(cuda_settings.registry, "support-bot")
    held = checkpoint_dir.load_checkpoint(path, full=False, allowed_manifest_fields=MANIFEST_FIELDS).manifest
    assert held["execution"]["backend"] == "cuda" and held["execution"]["gpu"]["name"] == gpu_name()


@pytest.mark.parametrize("case", list(CASES))
def test_cancel_then_resume_on_cuda_is_byte_identical(device, tmp_path, case):
    """Cancelled after step 1 (a checkpoint downloaded from the device) and resumed in a fresh CudaModel, the run
    ends with the same checkpoint and PEFT bytes as an uninterrupted cuda run."""
    config = dict(CASES[case], backend="cuda")
    whole_settings, whole, _ = run(tmp_path / "whole", **config)
    settings, first, _ = run(tmp_path / "resumed", stop=1, **config)
    assert first.status == "cancelled" and first.steps_completed == 1
    opened = len(device)
    _, second, _ = run(tmp_path / "resumed", resume=first.latest_checkpoint["resume_checkpoint"], **config)
    assert len(device) == opened + 1  # a fresh CudaModel for the resumed run
    assert second.status == "succeeded" and second.loss_history == whole.loss_history
    assert final_files(settings) == final_files(whole_settings)


def test_a_library_that_cannot_be_loaded_fails_the_run_with_the_loaders_reason(device, tmp_path, monkeypatch):
    """The probe found a device, but the library will not load when the run builds its CudaModel: the run fails
    before any step with backend_unavailable and the loader's reason, and publishes nothing."""
    from native_ext import cuda

    def refuse(min_capability=(8, 0)):
        raise cuda.CudaUnavailable("driver_missing", None, "libcuda.so.1 went away")

    monkeypatch.setattr(cuda, "load", refuse)
    settings = make_settings(tmp_path)
    admission = admit_sft(request(write_dataset(tmp_path, SMALL), backend="cuda"), settings)
    with pytest.raises(AdmissionError) as refused:
        run_sft(admission, settings, StopAt(None))
    assert refused.value.code == "backend_unavailable" and "libcuda.so.1 went away" in refused.value.message
    assert checkpoint_dir.latest_checkpoint(settings.registry, "support-bot") is None


@pytest.mark.parametrize("precision", ["bfloat16", "tfloat32"])
def test_a_tensor_core_precision_is_its_own_run_bound_into_its_identity(device, tmp_path, monkeypatch, precision):
    """config.precision bfloat16 or tfloat32 on cuda: the device model's frozen base computes at it (the CPU model
    stays float32: no oneDNN copy), the execution identity records it (without oneDNN), the run ends within 5e-2
    of float32's losses but not on them, a cancelled run resumes to the uninterrupted run's bytes, and a resume
    that asks for another precision is drift naming config.precision."""
    from trainer.cuda_model import CudaModel

    precisions, real_init = [], CudaModel.__init__

    def spy(self, model, library=None, precision="float32"):  # (device precision, the CPU model's)
        precisions.append((precision, model.config.base_precision))
        real_init(self, model, library, precision)

    monkeypatch.setattr(CudaModel, "__init__", spy)
    config = dict(backend="cuda", precision=precision)
    _, exact, _ = run(tmp_path / "float32", backend="cuda")
    whole_settings, whole, _ = run(tmp_path / "whole", **config)
    assert whole.status == "succeeded" and precisions[-1] == (precision, "float32")
    assert whole.loss_history != exact.loss_history
    assert relative(whole.loss_history, exact.loss_history) <= 5e-2
    path = checkpoint_dir.latest_checkpoint(whole_settings.registry, "support-bot")
    held = checkpoint_dir.load_checkpoint(path, full=False, allowed_manifest_fields=MANIFEST_FIELDS).manifest
    assert held["execution"]["precision"] == precision and "onednn" not in held["execution"]
    assert held["config"]["precision"] == precision

    settings, first, _ = run(tmp_path / "resumed", stop=1, **config)
    basename = first.latest_checkpoint["resume_checkpoint"]
    other = "tfloat32" if precision == "bfloat16" else "bfloat16"
    with pytest.raises(AdmissionError) as drift:
        run(tmp_path / "resumed", resume=basename, backend="cuda", precision=other)
    assert drift.value.code == "resume_drift"
    assert "config.precision" in {d["field"] for d in drift.value.differences}
    _, second, _ = run(tmp_path / "resumed", resume=basename, **config)
    assert second.status == "succeeded" and second.loss_history == whole.loss_history
    assert final_files(settings) == final_files(whole_settings)
